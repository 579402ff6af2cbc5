"""Every command in README.md and ``docs/*.md`` is exercised: each ``python train.py ...`` line of their ```bash
blocks (``\\`` continuations joined, ``# comments`` dropped) composes and validates as the job would before it
starts ranks, and each ``python -m disttrain...`` line runs as typed (generation shortened to a few tokens).

A ``train.py`` command is composed from ``conf/`` (``tests.conftest.compose_config``) and validated
(``disttrain.config.validation.validate``), the job's last step before it writes ``config.yaml`` and starts
ranks; under ``mode=plan`` the plan is printed too, which is the whole of such a job. Validation needs no ranks, so a
command for 8 GPUs validates on this CPU at the same world size. A sweep (``-m``) validates each of its jobs;
``--help`` and ``--cfg`` validate the config they would show. Under torchrun or srun only the ``train.py``
arguments count, validated as each launched rank validates them: with the launcher's ``WORLD_SIZE`` and
``LOCAL_RANK`` set. A ```text block right after a command that starts with ``Error:`` is the error the page
promises for it: validation must refuse the command with that line (numbers aside). Under ``mode=dryrun`` the
dry run runs too (one rank of the layout, the whole of such a job).

Placeholders name the reader's own files, which the test makes (small) on first use: ``DIR`` and ``notes.txt``
(a Hugging Face model folder and a text file, by ``tests.test_cli.with_own_files``), ``RUN_DIR`` and
``outputs/runs/<time>`` (a finished run, trained here), ``LORA_RUN`` (the same with LoRA adapters), ``TOKENS_DIR``
and ``IMAGES_DIR`` (token files and an image folder, by the helpers of ``test_cli`` and ``test_image_folder``),
``chat.jsonl`` and ``qa.parquet`` (chat rows, by ``test_chat_data``'s), ``TASKS_DIR`` and ``TUNED_RUN`` (task files
over local data, and a run fine-tuned from ``DIR``, for ``eval``); a page's ```python block that starts
with ``# NAME.py`` is that file, written where the commands run.

The README's first block's ``train.py`` commands run whole, shortened by step counts, in ``tests/test_cli.py``
and ``tests/test_recipes.py`` (``readme_commands``); they are not validated again here.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import runpy
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pytest

from disttrain.config.validation import validate
from disttrain.errors import ConfigError
from tests.conftest import ROOT, compose_config
from tests.test_cli import readme_commands, token_files, uses_gpus, with_own_files
from tests.test_image_folder import write_classes

PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
"""The documentation whose commands are checked."""

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
"""A fenced block: its language and its text."""

HYDRA_FLAGS = {"-m": 0, "--multirun": 0, "--help": 0, "-h": 0, "--resolve": 0, "--cfg": 1, "-c": 1}
"""Hydra's own options a documented command may carry, and how many values each takes: the config they act on is
what is validated."""

TINY_RUN = ["model=llama", "data=pydocs", "batch.global_size=8", "trainer.max_steps=1", "trainer.limit_val_batches=1",
            "trainer.run_test=false", "logger=none", "callbacks=none"]
"""The finished run that ``RUN_DIR`` and ``outputs/runs/<time>`` stand for: one step of the default Llama on
Python's docs, a model that every command naming a run takes (resume on another layout, export to Hugging Face,
generation)."""

SHORT_MODULE_ARGS = {"disttrain.generate": ["--max-new-tokens", "4"]}
"""What shortens a module's command (the last value of an option wins), as step counts shorten a run."""


@dataclass(frozen=True)
class DocCommand:
    """One command of a page, as typed."""

    page: str
    """The page, relative to the repository."""
    line: str
    """The command with its continuations joined and its comment dropped."""
    args: tuple[str, ...]
    """What follows ``train.py`` (or the module's name)."""
    module: str | None = None
    """``disttrain.x`` for ``python -m disttrain.x``; None for ``train.py``."""
    launcher: dict[str, str] = field(default_factory=dict)
    """The rank variables a launcher (torchrun, srun) would set for the first rank; empty for none."""
    on_path: bool = False
    """Whether the command puts its working directory on the import path (``PYTHONPATH=.``)."""
    error: str | None = None
    """The ``Error:`` line the page shows for this command, if it shows one."""

    def __str__(self) -> str:
        return f"{self.page}: {self.line}"


def launched_world(world: int, per_node: int) -> dict[str, str]:
    """The variables a launcher sets in the first of ``world`` ranks, ``per_node`` on each node."""
    return {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node), "RANK": "0", "LOCAL_RANK": "0",
            "GROUP_RANK": "0", "NODE_RANK": "0"}


def largest(count: str) -> int:
    """A launcher's node count, or a range's largest (``1:4`` -> 4)."""
    return int(count.rsplit(":", 1)[-1])


def parse_command(tokens: list[str], sbatch: dict[str, str]) -> tuple[str | None, list[str], dict, bool] | None:
    """``(module, args, launcher variables, on the import path)`` of a command line's words; None for a command
    that is not disttrain's (``make``, ``python benchmarks/...``, Flower's tools)."""
    on_path = False
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # PYTHONPATH=. python train.py ...
        on_path = on_path or tokens[0] == "PYTHONPATH=."
        tokens = tokens[1:]
    launcher: dict[str, str] = {}
    if tokens[:1] == ["srun"]:  # the job's size comes from the #SBATCH line above it
        per_node = int(sbatch["--ntasks-per-node"])
        launcher, tokens = launched_world(largest(sbatch["--nodes"]) * per_node, per_node), tokens[1:]
    if tokens[:1] == ["torchrun"] and "train.py" in tokens:
        at = tokens.index("train.py")
        options = dict(token.lstrip("-").replace("_", "-").split("=", 1) for token in tokens[1:at] if "=" in token)
        per_node = int(options.get("nproc-per-node", "1"))
        return None, tokens[at + 1:], launched_world(largest(options.get("nnodes", "1")) * per_node, per_node), on_path
    if tokens[:2] == ["python", "train.py"]:
        return None, tokens[2:], launcher, on_path
    if tokens[:2] == ["python", "-m"] and tokens[2].startswith("disttrain"):
        return tokens[2], tokens[3:], launcher, on_path
    return None


def page_commands(page: Path) -> list[DocCommand]:
    """The disttrain commands of ``page``'s ```bash blocks, in order."""
    text, name, commands = page.read_text(), str(page.relative_to(ROOT)), []
    blocks = list(FENCE.finditer(text))
    for block, after in zip(blocks, [*blocks[1:], None], strict=True):
        if block[1] != "bash":
            continue
        shown = after[2] if after is not None and after[1] == "text" and not text[block.end():after.start()].strip() \
            else ""
        sbatch = dict(re.findall(r"(--[\w-]+)=(\S+)", "\n".join(re.findall(r"^#SBATCH (.*)$", block[2], re.M))))
        found = []
        for line in block[2].replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            parsed = parse_command(tokens, sbatch) if tokens else None
            if parsed is not None:
                module, args, launcher, on_path = parsed
                typed = " ".join(shlex.quote(token) for token in tokens)
                found.append(DocCommand(name, typed, tuple(args), module, launcher, on_path))
        if shown.startswith("Error:") and found:  # the error the page shows for the block's last command
            found[-1] = dataclasses.replace(found[-1], error=" ".join(shown.split()))
        commands += found
    return commands


RUN_ELSEWHERE = {" ".join(args) for args in readme_commands()}
"""The README's first block's ``train.py`` commands, which ``test_cli.py`` and ``test_recipes.py`` run whole."""

COMMANDS = [command for page in PAGES for command in page_commands(page)
            if not (command.page == "README.md" and command.module is None and command.line.startswith("python ")
                    and " ".join(command.args) in RUN_ELSEWHERE)]


class OwnFiles:
    """The reader's files that the pages' placeholders stand for, made in ``folder`` on first use."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @cached_property
    def hf(self) -> tuple[str, str]:
        """A Hugging Face model folder with its tokenizer, and a text file (``test_cli``'s)."""
        model_dir, notes = with_own_files(["DIR", "notes.txt"], self.folder)
        return model_dir, notes

    @cached_property
    def run(self) -> str:
        """A finished run's directory (``TINY_RUN``)."""
        from disttrain.launch.job import train

        train(compose_config(TINY_RUN, self.folder / "run"))
        return str(self.folder / "run")

    @cached_property
    def lora_run(self) -> str:
        """A finished run's directory with LoRA adapters (``TINY_RUN`` with ``model.lora.rank=4``)."""
        from disttrain.launch.job import train

        train(compose_config([*TINY_RUN, "model.lora.rank=4"], self.folder / "lora_run"))
        return str(self.folder / "lora_run")

    @cached_property
    def tasks(self) -> str:
        """A folder of two lm-evaluation-harness task files over local JSONL (``test_eval_tasks``'s)."""
        from tests.test_eval_tasks import write_tasks

        return str(write_tasks(self.folder))

    @cached_property
    def tuned(self) -> str:
        """A finished run's directory: one step of fine-tuning the ``DIR`` model on ``notes.txt``, with the
        tokenizer naming its end-of-text token (which the harness puts before a document)."""
        import json
        import shutil

        from disttrain.launch.job import train
        from tests.test_text_data import EOS

        model_dir, notes = self.hf
        tokenizer = self.folder / "tokenizer"
        tokenizer.mkdir()
        shutil.copy(Path(model_dir) / "tokenizer.json", tokenizer)
        (tokenizer / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
        train(compose_config(["model=hf", f"model.path={model_dir}", "model.pretrained=true", "data=text",
                              f"data.files=[{notes}]", f"data.tokenizer={tokenizer}", "data.block_size=32",
                              *TINY_RUN[2:]], self.folder / "tuned"))
        return str(self.folder / "tuned")

    @cached_property
    def tokens(self) -> str:
        """A folder of nanoGPT-style token files (``test_cli``'s)."""
        return str(token_files(self.folder / "tokens"))

    @cached_property
    def images(self) -> str:
        """A folder of images, one folder per class (``test_image_folder``'s)."""
        return str(write_classes(self.folder / "images", per_class=32))  # a training split of one default batch

    @cached_property
    def chat(self) -> str:
        """Conversations and prompt/response pairs, one JSON object per line (``test_chat_data``'s rows)."""
        from tests.test_chat_data import conversations, write_jsonl

        return str(write_jsonl(self.folder / "chat" / "chat.jsonl", conversations(80)))

    @cached_property
    def qa(self) -> str:
        """Prompt/response pairs as a Parquet file whose columns are ``question`` and ``answer``."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from tests.test_chat_data import conversations

        rows = [{"question": row["prompt"], "answer": row["response"]} for row in conversations(160) if "prompt" in row]
        (self.folder / "qa").mkdir(exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), self.folder / "qa" / "qa.parquet")
        return str(self.folder / "qa" / "qa.parquet")

    @cached_property
    def mixture(self) -> str:
        """A folder of mixture sources and their tokenizer (``python -m disttrain.data.pydocs_sources``'s)."""
        from disttrain.data.pydocs_sources import write_pydocs_sources

        write_pydocs_sources(self.folder / "mixture")
        return str(self.folder / "mixture")

    def fill(self, arg: str) -> str:
        """``arg`` with every placeholder replaced by the file made for it."""
        for placeholder, made in (("outputs/runs/<time>", "run"), ("RUN_DIR", "run"), ("LORA_RUN", "lora_run"),
                                  ("TOKENS_DIR", "tokens"), ("IMAGES_DIR", "images"), ("chat.jsonl", "chat"),
                                  ("qa.parquet", "qa"),
                                  ("TASKS_DIR", "tasks"), ("TUNED_RUN", "tuned"), ("MIXTURE_DIR", "mixture")):
            if placeholder in arg:
                arg = arg.replace(placeholder, getattr(self, made))
        if re.search(r"\bDIR\b", arg) or "notes.txt" in arg:
            model_dir, notes = self.hf
            arg = re.sub(r"\bDIR\b", model_dir, arg).replace("notes.txt", notes)
        return arg


@pytest.fixture(scope="module")
def own_files(tmp_path_factory) -> OwnFiles:
    return OwnFiles(tmp_path_factory.mktemp("own_files"))


def write_page_modules(page: str, folder: Path) -> list[str]:
    """The page's ```python blocks that open with ``# NAME.py``, written to ``folder``; their module names."""
    names = []
    for language, body in FENCE.findall((ROOT / page).read_text()):
        named = re.match(r"# (\w+)\.py\b", body)
        if language == "python" and named:
            (folder / f"{named[1]}.py").write_text(body)
            names.append(named[1])
    return names


def jobs_of(args: list[str]) -> list[list[str]]:
    """The override lists Hydra would compose for ``args``: its own options set aside, a sweep (``-m``) expanded
    into its jobs as Hydra's basic sweeper does."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides, sweep, rest = [], False, iter(args)
    for arg in rest:
        if arg in HYDRA_FLAGS:
            sweep = sweep or arg in ("-m", "--multirun")
            for _ in range(HYDRA_FLAGS[arg]):
                next(rest)
        else:
            assert not arg.startswith("-"), f"{arg}: a Hydra option this test does not know"
            overrides.append(arg)
    if not sweep:
        return [overrides]
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [[f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()] if o.is_sweep_override()
               else [o.input_line] for o in parsed]
    return [list(job) for job in itertools.product(*choices)]


def without_numbers(line: str) -> str:
    """``line`` with every number as ``#``: an error line's wording, whatever the figures in it."""
    return re.sub(r"\d+(\.\d+)?", "#", line)


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_a_documented_command_works_as_typed(command, own_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    modules = write_page_modules(command.page, tmp_path)
    if command.on_path:
        monkeypatch.syspath_prepend(str(tmp_path))
    args = [own_files.fill(arg) for arg in command.args]  # before a launcher's variables: the run trains alone
    for name, value in command.launcher.items():
        monkeypatch.setenv(name, value)
    try:
        if command.module is not None:
            run_module(command.module, [*args, *SHORT_MODULE_ARGS.get(command.module, [])], monkeypatch)
        else:
            for job in jobs_of(args):
                validate_as_the_job(command, job, tmp_path / "run")
    finally:
        for name in modules:
            sys.modules.pop(name, None)


def validate_as_the_job(command: DocCommand, overrides: list[str], run_dir: Path) -> None:
    """Compose ``overrides`` and validate them as the job does before it starts ranks (a plan: and print it);
    the command must be refused exactly where its page shows an error."""
    try:
        run = validate(compose_config(overrides, run_dir))
    except ConfigError as err:
        if command.error is not None:
            shown = without_numbers(command.error)
            assert without_numbers(f"Error: {err}").startswith(shown), f"{command}: refused with 'Error: {err}'"
            return
        if uses_gpus() and "as this machine shows" in str(err):
            pytest.skip(f"{command}: {err}")  # more GPU ranks than this machine has
        raise
    assert command.error is None, f"{command}: validation accepted it, the page shows {command.error!r}"
    if run.train.mode == "plan":
        from disttrain.plan.planner import print_plan

        print_plan(run)
    if run.train.mode == "dryrun":
        from disttrain.plan.dryrun import dry_run

        dry_run(run)


def run_module(module: str, args: list[str], monkeypatch) -> None:
    """``python -m module *args`` in this process: its exit status must be 0."""
    monkeypatch.setattr(sys, "argv", [module, *args])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already (by the suite)
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            assert stop.code in (None, 0), f"python -m {module} {shlex.join(args)} exited with {stop.code}"


def test_every_page_command_is_in_a_bash_block():
    """A command shown elsewhere (an indented block, a ```text block) would escape the test above, unless a bash
    block of its page holds it too."""
    for page in PAGES:
        text = page.read_text()
        checked = {command.line for command in page_commands(page)}
        outside = FENCE.sub(lambda block: "" if block[1] == "bash" else block[2], text)
        for line in outside.splitlines():
            line = line.strip()
            if re.match(r"(python (train\.py|-m disttrain)|torchrun |srun |PYTHONPATH=)", line):
                tokens = shlex.split(line, comments=True)
                assert " ".join(shlex.quote(t) for t in tokens) in checked, f"{page.name}: {line}"


def test_the_pages_have_commands_and_the_readme_links_them():
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
        if page.name != "fault_tolerance_design.md":  # example-led: commands first
            assert "```bash" in page.read_text(), f"docs/{page.name} shows no command"
    for page in PAGES:  # every relative link leads to a file
        for target in re.findall(r"\]\(([^)#]+)", page.read_text()):
            assert target.startswith("http") or (page.parent / target).exists(), f"{page.name}: {target}"

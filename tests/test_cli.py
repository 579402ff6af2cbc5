"""The command line as a user sees it: the README's commands run as typed (shortened by step counts only),
every mistake is one ``Error:`` line with a non-zero exit and no run directory, and a run ends with a
summary whose figures are those of ``results.json``.

The README's commands, the own-model example (``docs/your_own_model.md``), the mistakes and the notices run
``train.py`` in this process (``train_cli_in_process``): the same script executed as ``__main__``, so the same
Hydra entry point, config search path, composition and one-line errors, with the argv, working directory,
environment and import path the subprocess gets, and output captured at the descriptor level. A fresh interpreter
would only add its start-up (importing torch and Lightning, several seconds a case), and multi-rank runs fork their
ranks from this process's warm fork server instead of a new one. ``HYDRA_FULL_ERROR`` and the headline command keep the
real subprocess (``train_cli``): they check the command as a shell runs it, interpreter start and all."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from disttrain.launch.job import train
from tests.conftest import ROOT, compose_config, logged_metric, train_cli, train_cli_in_process
from tests.test_recipes import RUN_AS_TYPED

SHORT = ["trainer.max_steps=2", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]


run_cli = train_cli


run_here = train_cli_in_process
"""``python train.py ...`` in this process (see ``train_cli_in_process``)."""


def readme_commands() -> list[list[str]]:
    """The ``python train.py ...`` lines of the README's first code block, as argument lists; sweeps (``-m``,
    ``hparams_search``) and torchrun run in ``test_sweep.py``, the recipes of ``RUN_AS_TYPED`` (longer) in
    ``test_recipes.py``."""
    block = (ROOT / "README.md").read_text().split("```bash", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("python train.py") and " -m " not in line and "hparams_search=" not in line:
            commands.append(shlex.split(line)[2:])
    return commands


def uses_gpus() -> bool:
    """Whether this session runs on GPUs (``DISTTRAIN_TEST_DEVICE=cuda`` on a machine that has them)."""
    from tests.conftest import cuda_skip_reason

    return cuda_skip_reason() is None


def shortened(args: list[str]) -> list[str]:
    if "--help" in args or "--cfg" in args or "mode=plan" in args:
        return args
    return [*args, "trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"]


PLACEHOLDERS = ("DIR", "notes.txt")
"""What the README's commands name as the reader's own files: a Hugging Face model folder (with its tokenizer)
and a text file; the test makes both and puts their paths in."""


def with_own_files(args: list[str], folder: Path) -> list[str]:
    """``args`` with the README's placeholders replaced by real files made in ``folder``."""
    if not any(name in arg for arg in args for name in PLACEHOLDERS):
        return args
    import torch
    import transformers

    from tests.test_text_data import EOS, make_tokenizer, topic_texts

    model_dir = make_tokenizer(folder / "hf", vocab_size=300)
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))  # as a released model names it
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    notes = folder / "notes.txt"
    notes.write_text("\n\n".join(topic_texts()[:30]), encoding="utf-8")
    return [re.sub(r"\bDIR\b", str(model_dir), arg).replace("notes.txt", str(notes)) for arg in args]


@pytest.mark.parametrize("args", [args for args in readme_commands() if " ".join(args) not in RUN_AS_TYPED],
                         ids=lambda a: " ".join(a) or "(none)")
def test_readme_command_runs_as_typed(tmp_path, args):
    """Also the README on a GPU (``DISTTRAIN_TEST_DEVICE=cuda``): a command that needs more GPU ranks than the
    machine has is that one-line error before any rank starts, and skips with it as the reason."""
    proc = run_here(shortened(with_own_files(args, tmp_path)), tmp_path)
    if proc.returncode == 2 and uses_gpus() and any(
            reason in proc.stderr for reason in ("as this machine shows", "of 1 rank(s) here")):
        pytest.skip(proc.stderr.strip())  # more GPU ranks than this machine has, asked for or implied by the layout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if "--help" in args:  # our groups and options, not the schemas they start from
        assert "schema/" not in proc.stdout
        assert "parallel: auto, ddp, diloco, federated, hsdp, hybrid, localsgd, param_server, pipeline" in proc.stdout
    elif "mode=plan" in args:
        assert "predicted step:" in proc.stdout and "Run complete:" not in proc.stdout, proc.stdout[-2000:]
    elif "--cfg" not in args:
        assert "Run complete:" in proc.stdout, proc.stdout[-2000:]


def test_lightning_lines_print_once_where_the_job_logs_through_the_root_logger():
    # the ``lightning`` package's logger has a console handler of its own and propagates too; Hydra's job logging
    # gives the root logger the console and train.log (a test's in-process run cannot show it: Lightning's handler
    # writes to the stream it found at import, not to what the test captures)
    import io
    import logging

    import lightning

    from disttrain.report.console import quiet_noise

    package, root, console = logging.getLogger("lightning"), logging.getLogger(), lightning._console
    handlers, root_handlers, console_stream = list(package.handlers), list(root.handlers), console.stream
    stream = io.StringIO()
    try:
        console.setStream(stream)
        root.handlers[:] = [logging.StreamHandler(stream)]
        quiet_noise()
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("`Trainer.fit` stopped: `max_steps=2` reached.")
        assert stream.getvalue().count("Trainer.fit") == 1, stream.getvalue()
        # the accelerators Lightning looked for are not shown at all
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("GPU available: False, used: False")
        logging.getLogger("lightning.pytorch.utilities.rank_zero").info("TPU available: False, using: 0 TPU cores")
        assert "available" not in stream.getvalue()
    finally:
        package.handlers[:], root.handlers[:] = handlers, root_handlers
        console.setStream(console_stream)


def test_help_is_hydras_own_help_composed_once(tmp_path, monkeypatch):
    import disttrain.launch.help

    args = ["parallel=zero3", "optim=lamb", "--help"]
    ours = run_here(args, tmp_path)
    assert ours.returncode == 0 and "name: lamb" in ours.stdout  # the composed config, with the overrides
    monkeypatch.setattr(disttrain.launch.help, "help_overrides", lambda argv: None)  # Hydra's own path
    hydras = run_here(args, tmp_path)
    assert hydras.returncode == 0 and ours.stdout == hydras.stdout


def test_readme_own_model_example_trains_as_typed(tmp_path):
    # the README's page on your own model (``-k readme`` runs it on a GPU too): its first module and commands
    section = (ROOT / "docs" / "your_own_model.md").read_text()
    module = section.split("```python", 1)[1].split("```", 1)[0]
    name = re.search(r"# (\w+)\.py", module)[1]
    (tmp_path / f"{name}.py").write_text(module)
    lines = section.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("PYTHONPATH=. python train.py") for line in lines)
    for line in lines:
        proc = run_here(shortened(shlex.split(line)[3:]), tmp_path, pythonpath=(tmp_path,))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        ranks = torch.cuda.device_count() if uses_gpus() else 2  # trainer.devices=auto: every GPU, else 2 CPU ranks
        assert f"Run complete: 2 steps on {ranks} rank(s)" in proc.stdout, proc.stdout[-2000:]


# the same command runs in this process among the README's (composition, ranks, summary), and a new interpreter
# starting ranks runs in test_worker_start.py's script test: this adds only the shell's start of train.py
@pytest.mark.slow
def test_the_headline_command_starts_the_ranks_it_needs(tmp_path):
    proc = run_cli(["parallel=zero3", "optim=lamb", *SHORT, "hydra.run.dir=run"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trainer.devices=auto: starting 2 CPU ranks" in proc.stdout
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["world_size"] == 2 and results["parallel"]["dp_shard"] == 2


def token_files(directory: Path, stray: int | None = None) -> Path:
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", 4096), ("val", 1024)):
        ids = rng.integers(0, 300, size, dtype=np.uint16)
        if stray is not None and split == "val":
            ids[700] = stray
        ids.tofile(directory / f"{split}.bin")
    return directory


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["+optim.lrr=1"], "optim.lrr=1 is invalid: not a known key (did you mean optim.lr?)"),
        (["trainer.max_stepz=3"],
         "trainer.max_stepz='3' is invalid: not a known key (did you mean trainer.max_steps?)"),
        (["optim.lr=abc"], "optim.lr='abc' is invalid: expected type float"),
        (["parallel=zer3"], "parallel='zer3' is invalid: one of ['auto', 'ddp', 'diloco',"),
        (["optim.lr=[1"], "cannot read the override 'optim.lr=[1': no viable alternative at input '[1'"),
        (["optim.lr=-1"], "optim.lr=-1.0 is invalid: a positive number"),
        (["parallel=ddp", "trainer.devices=0"], "trainer.devices=0 is invalid"),
        (["trainer.precision=16-mixed"], "fp16 autocast needs a gradient scaler"),
        (["trainer.precision=64-true"], "trainer.precision='64-true' is invalid: one of"),
        (["model=gpt", "data=tokens"], "data.path='???' is invalid: a value is required"),
        (["resume=."], "a checkpoint folder (with meta.pt) or a run directory with checkpoints/last.ckpt"),
        (["model=gpt", "data=tokens", "data.path=tokens", "data.vocab_size=512"],
         "data.vocab_size=512 is invalid: more than every token id: val.bin holds id 60000 at position 700"),
        (["model=gpt"], "model.name='gpt' is invalid: a model for image data; gpt needs text data"),
        (["model=gpt", "data=pydocs", "parallel=tp", "parallel.sequence_parallel=true", "trainer.devices=1"],
         "parallel.sequence_parallel=true is invalid: false unless parallel.tp > 1 (tp=1 of 1 rank(s) here)"),
    ],
    ids=["unknown-key", "typo-key", "wrong-type", "no-such-option", "unparsable", "negative-lr",
         "devices-0", "fp16", "fp64", "no-path", "resume-dir", "stray-id", "gpt-images", "sp-one-rank"],
)
def test_a_mistake_is_one_line_with_no_run_directory(tmp_path, args, message):
    token_files(tmp_path / "tokens", stray=60000)
    before = set(tmp_path.iterdir())
    proc = run_here(args, tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"Error: {proc.stderr.strip().removeprefix('Error: ')}"
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
    assert set(tmp_path.iterdir()) == before  # no outputs/ left behind


def test_a_command_run_here_leaves_this_process_as_it_found_it(tmp_path):
    import logging
    import os
    import sys

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    root, hydra_config = logging.getLogger(), HydraConfig.initialized()
    before = (os.getcwd(), list(sys.argv), list(sys.path), dict(os.environ), list(root.handlers), root.level)
    for args in (["trainer.max_stepz=3"], [*SHORT, "logger=none", "trainer.run_test=false"]):
        proc = run_here(args, tmp_path)
        assert proc.returncode == (2 if "trainer.max_stepz=3" in args else 0), proc.stderr[-2000:]
        assert (os.getcwd(), sys.argv, sys.path, dict(os.environ), root.handlers, root.level) == before
        assert not GlobalHydra.instance().is_initialized() and HydraConfig.initialized() == hydra_config
    assert "Run complete:" in proc.stdout and (tmp_path / "outputs").is_dir()


def test_hydra_full_error_keeps_the_traceback(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "optim.lr=abc"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "ConfigCompositionException" in proc.stderr


def test_notices_say_what_may_surprise(tmp_path):
    token_files(tmp_path / "tokens", stray=5000)
    proc = run_here(["model=gpt", "model.flavour=micro", "data=tokens", "data.path=tokens", "trainer.max_steps=40",
                    "trainer.max_epochs=1", "data.samples_per_epoch=320", "batch.global_size=32",
                    "trainer.run_test=false", "logger=none", "trainer.val_check_interval=50",
                    "trainer.check_val_every_n_epoch=null"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "data.vocab_size inferred as 5056 from the largest id 5000, but only 301 distinct ids" in proc.stdout
    assert "trainer.max_steps=40 sets the length: 4 epochs of 10 steps" in proc.stdout
    assert "trainer.val_check_interval=50 is beyond trainer.max_steps=40: this run never validates" in proc.stdout


def test_summary_figures_are_those_of_results(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(compose_config(["trainer.max_epochs=1", "logger=none"], run_dir))
    printed = capsys.readouterr().out
    summary = printed[printed.index("Run complete:"):]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["best_checkpoint"] and results["tokens_per_sec"] is None
    assert f"{results['global_steps']} steps on 1 rank(s), {results['wall_time_s']:g} s" in summary
    assert f"{results['samples_per_sec']:g} samples/s" in summary
    assert f"best val/acc {results['best']['value']:.4f} (checkpoints/" in summary
    for key in ("test/acc", "test/loss"):
        assert f"{key} {results['metrics'][key]:.4f}" in summary
    assert str(run_dir) in summary
    assert not re.search(r"\x1b\[", printed)


def test_logged_steps_count_as_the_console_and_checkpoints_do(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(compose_config(["trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.val_check_interval=2",
                          "trainer.run_test=false", "logger=csv", "checkpoint.save_top_k=-1"], run_dir))
    printed = capsys.readouterr().out
    console = {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+)/4 \| .*?loss (\S+)", printed, re.M)}
    logged = dict(logged_metric(run_dir, "train/loss"))
    assert sorted(logged) == [1, 2, 3, 4] and sorted(console) == [1, 2, 3, 4]
    assert all(abs(console[step] - logged[step]) < 1e-4 for step in console)
    validated = [step for step, _ in logged_metric(run_dir, "val/loss")]
    assert validated == [2, 4] and [step for step, _ in logged_metric(run_dir, "train/lr")] == [1, 2, 3, 4]
    saved = sorted(int(p.name[4:-5]) for p in (run_dir / "checkpoints").glob("step*.ckpt"))
    assert saved == validated
    assert "validation at step 2:" in printed


def test_model_summary_leaves_out_flops_it_did_not_count(capsys):
    from lightning.pytorch.utilities.model_summary import summarize
    from torch import nn

    from disttrain.rank.callbacks import SummaryWithoutFlops

    model = pl.LightningModule()
    model.net = nn.Linear(3, 2)
    summary = summarize(model)
    SummaryWithoutFlops.summarize(summary._get_summary_data(), summary.total_parameters,
                                  summary.trainable_parameters, summary.model_size, summary.total_training_modes,
                                  summary.total_flops)
    printed = capsys.readouterr().out
    assert "Total params" in printed and "8 " in printed and "FLOPs" not in printed and "Flops" not in printed

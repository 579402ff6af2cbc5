"""lm-evaluation-harness tasks scored inside a run (``eval.tasks``): a multiple-choice task and a generation task
over local JSONL files that the test writes, scored on a tiny Llama as it trains on one rank and on two (ZeRO-3),
equal to the harness's own ``hf`` model on the same checkpoint exported to Hugging Face's format (same task, same
few-shot seed); the command line on a checkpoint; the refusals before ranks start."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from disttrain.errors import ConfigError  # noqa: E402
from tests.conftest import compose_config  # noqa: E402
from tests.test_hf_export_folder import llama_folder  # noqa: E402
from tests.test_text_data import write_corpus  # noqa: E402

SUMS = [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3), (9, 9), (5, 2)]
"""The documents: questions about sums, three choices each (10 documents: two ranks score unequal shares of the
30 multiple-choice requests' contexts once sorted, and of the generations)."""
MC_TASK = """task: sums_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    train: {data}
test_split: test
fewshot_split: train
output_type: multiple_choice
doc_to_text: "{{{{question}}}} Answer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """task: sums_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    train: {data}
test_split: test
fewshot_split: train
output_type: generate_until
doc_to_text: "{{{{question}}}} Answer:"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs:
  until: ["\\n", ".", "6"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""
TASKS = ["sums_mc", "sums_gen"]
# the tiny model writes "6" at different points of its continuations (or never): the two ranks' shares of the
# generations then run different numbers of forwards, which the ranks must still pair up
SCORE_ATOL = 1e-6
"""acc_norm, a mean of per-document decisions on log-likelihoods, against the harness's."""
# measured: a document's log-likelihood (a sum near -11) within 1.7e-7 relative of the harness's (the requests are
# batched with others than the harness's batches hold)
LOGLIK_RTOL = 1e-6


def write_tasks(root: Path) -> Path:
    """The documents as JSONL and the two task YAML files that read them; the folder of the YAML files."""
    rows = [{"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b)],
             "answer": i % 3} for i, (a, b) in enumerate(SUMS)]
    data = root / "sums.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "sums_mc.yaml").write_text(MC_TASK.format(data=data))
    (tasks / "sums_gen.yaml").write_text(GEN_TASK.format(data=data))
    return tasks


def eval_overrides(tasks: Path, *more: str) -> list[str]:
    """``eval.*`` of the two tasks (one few-shot example, the documents written here only)."""
    return [f"eval.tasks=[{','.join(TASKS)}]", f"eval.include_path={tasks}", "eval.include_defaults=false",
            "eval.num_fewshot=1", *more]


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> dict:
    """A Llama folder (seeded weights, its tokenizer), a text corpus of its tokenizer and the two tasks."""

    root = tmp_path_factory.mktemp("eval")
    folder = llama_folder(root / "llama", max_length=64)
    files, _ = write_corpus(root / "corpus")
    return {"root": root, "folder": folder, "files": files, "tasks": write_tasks(root)}


def run_overrides(setting: dict, *more: str) -> list[str]:
    """Fine-tune the folder's model for three steps, scoring the tasks before training, at each validation (every
    other step) and at the end, and ranking checkpoints by the multiple-choice accuracy."""
    return ["model=hf", f"model.path={setting['folder']}", "model.pretrained=true", "data=text",
            f"data.files=[{','.join(map(str, setting['files']))}]", f"data.tokenizer={setting['folder']}",
            "data.block_size=32", "batch.global_size=8", "trainer.max_steps=3", "trainer.val_check_interval=2",
            "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=1", "trainer.run_test=false",
            "logger=csv", "callbacks=none", "optim.lr=1e-3", "fault_tolerance.hang_timeout_s=120",
            "trainer.validate_before_training=true", "checkpoint.monitor=eval/sums_mc/acc",
            *eval_overrides(setting["tasks"], "eval.write_samples=true"), *more]


@pytest.fixture(scope="module")
def runs(setting) -> dict:
    """Layout name -> run directory, each trained when first asked for."""
    from disttrain.launch.job import train

    done: dict[str, Path] = {}

    def run(layout: str) -> Path:
        if layout not in done:
            run_dir = setting["root"] / f"run-{layout}"
            more = {"single": ["parallel=single"], "zero3": ["parallel=zero3", "trainer.devices=2"],
                    "tp": ["parallel=tp", "trainer.devices=2"], "ddp": ["parallel=ddp", "trainer.devices=2"]}[layout]
            train(compose_config(run_overrides(setting, *more), run_dir))
            done[layout] = run_dir
        return done[layout]

    return run


def harness_scores(folder: Path, tasks: Path) -> tuple[dict[str, float], dict[str, list]]:
    """The harness's own scores (by disttrain's names) and scored documents of the two tasks with its ``hf`` model
    on a Hugging Face folder (fp32 on the CPU, its default seeds)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from disttrain.eval.scoring import scores_of

    results = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": str(folder), "device": "cpu",
                                                              "dtype": "float32"},
                                      tasks=TASKS, num_fewshot=1, bootstrap_iters=0, log_samples=True,
                                      task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    return scores_of(results), results["samples"]


def logged_scores(run_dir: Path) -> dict[int, dict[str, float]]:
    """Step -> the ``eval/*`` values that metrics.csv holds for it."""
    rows = {}
    (path,) = run_dir.glob("**/metrics.csv")
    with open(path) as handle:
        for row in csv.DictReader(handle):
            values = {key: float(value) for key, value in row.items() if key.startswith("eval/") and value}
            if values:
                rows.setdefault(int(float(row["step"])), {}).update(values)
    return rows


@pytest.mark.parametrize("layout", ["single", "zero3", *(pytest.param(layout, marks=pytest.mark.slow)
                                                         for layout in ("tp", "ddp"))])
def test_in_loop_scores_equal_the_harness_on_the_exported_checkpoint(setting, runs, layout, tmp_path):
    """The run's scores (logged, in results.json, ranking its checkpoint) are the harness's own with its ``hf``
    model on the exported last checkpoint, score by score and document by document. Under tensor parallelism both
    ranks score every request (one data-parallel rank); DDP's replicas split them as ZeRO-3's shards do."""
    from disttrain.checkpoint.export import export_hf

    run_dir = runs(layout)
    results = json.loads((run_dir / "results.json").read_text())
    scored = {scoring["step"]: scoring["scores"] for scoring in results["eval"]["scored"]}
    assert sorted(scored) == [0, 2, 3]
    logged = logged_scores(run_dir)
    assert sorted(logged) == [0, 2, 3]
    # the one validation during training (step 2) ranked its checkpoint by its score
    assert results["best"] == {"metric": "eval/sums_mc/acc", "value": pytest.approx(scored[2]["eval/sums_mc/acc"])}
    assert Path(results["best_checkpoint"]).name == "step2.ckpt"
    final = scored[3]
    assert logged[3] == pytest.approx(final, abs=0) and set(final) == {
        "eval/sums_mc/acc", "eval/sums_mc/acc_norm", "eval/sums_gen/exact_match"}
    for name, value in final.items():
        assert results["metrics"][name] == pytest.approx(value, abs=1e-7)

    theirs, their_samples = harness_scores(export_hf(run_dir, tmp_path / "hf"), setting["tasks"])
    assert theirs.keys() == final.keys()
    assert final["eval/sums_mc/acc"] == theirs["eval/sums_mc/acc"]
    assert final["eval/sums_gen/exact_match"] == theirs["eval/sums_gen/exact_match"]
    assert abs(final["eval/sums_mc/acc_norm"] - theirs["eval/sums_mc/acc_norm"]) <= SCORE_ATOL
    for task in TASKS:  # document by document: the same prompts, the same log-likelihoods and generations
        ours = [json.loads(line) for line in (run_dir / "eval" / f"step3-{task}.jsonl").read_text().splitlines()]
        assert [row["doc_id"] for row in ours] == [row["doc_id"] for row in their_samples[task]]
        for mine, their in zip(ours, their_samples[task], strict=True):
            assert mine["arguments"] == json.loads(json.dumps(their["arguments"], default=str))
            if task == "sums_gen":
                assert mine["filtered_resps"] == their["filtered_resps"], (mine, their)
            else:
                mine_ll = [float(resp[0][0]) for resp in mine["resps"]]
                their_ll = [float(resp[0][0]) for resp in their["resps"]]
                assert mine_ll == pytest.approx(their_ll, rel=LOGLIK_RTOL, abs=0)


@pytest.mark.parametrize(("change", "message"), [
    (["eval.tasks=[sums_mcq]"], "eval.tasks='sums_mcq' is invalid: a task of lm-evaluation-harness under "
                                "eval.include_path={tasks}; close to it: sums_mc"),
    (["eval.tasks=[sums_gen]", "MISSING"],
     "eval.tasks='sums_gen' is invalid: a task whose data files exist: {missing} does not (the "
     "dataset_kwargs.data_files of {tasks}/sums_gen.yaml)"),
    (["checkpoint.monitor=eval/sums_mc/acc", "eval.every_n_steps=2"],
     "checkpoint.monitor='eval/sums_mc/acc' is invalid: a score measured at every validation, which ranks "
     "checkpoints: eval.every_n_steps=null (it is 2)"),
    (["parallel=pipeline", "trainer.devices=2"], "eval.tasks=['sums_mc', 'sums_gen'] is invalid: [] under pipeline"),
], ids=["unknown-task", "missing-data-file", "monitor-not-every-validation", "pipeline"])
def test_what_cannot_be_scored_is_one_line_before_ranks_start(setting, tmp_path, change, message):
    """An unknown task, a data file that is not there, a monitored score not measured at every validation and a
    layout whose forward is not the model's own are each refused by validation, the job's step before ranks
    start, in one line naming the key."""
    from disttrain.config.validation import validate

    tasks = setting["tasks"]
    if "MISSING" in change:  # a copy of the generation task whose data file is gone
        tasks = tmp_path / "tasks"
        tasks.mkdir()
        missing = tmp_path / "gone.jsonl"
        text = (setting["tasks"] / "sums_gen.yaml").read_text()
        (tasks / "sums_gen.yaml").write_text(text.replace(str(setting["root"] / "sums.jsonl"), str(missing), 1))
        change = [c for c in change if c != "MISSING"]
    else:
        missing = None
    overrides = [o for o in run_overrides(setting) if not o.startswith(("eval.include_path", "checkpoint.monitor"))]
    with pytest.raises(ConfigError) as refused:
        validate(compose_config([*overrides, f"eval.include_path={tasks}", *change], tmp_path / "run"))
    text = str(refused.value)
    assert text.startswith(message.format(tasks=tasks, missing=missing)) and "\n" not in text, text


def test_the_command_line_scores_a_checkpoint_as_the_run_did(setting, runs, capsys):
    """``python -m disttrain.eval`` on the two-rank run's last checkpoint (the tasks of its own config, another
    few-shot number on the command line) scores what the harness scores on its export; with the run's own settings,
    what the run logged at its last step."""
    from disttrain.eval.__main__ import main

    run_dir = runs("zero3")
    final = json.loads((run_dir / "results.json").read_text())["eval"]["scored"][-1]["scores"]
    capsys.readouterr()  # the run's own output
    main([str(run_dir / "checkpoints" / "last.ckpt")])
    printed = capsys.readouterr().out
    assert printed.startswith(f"scores of {run_dir / 'checkpoints' / 'last.ckpt'}:")
    found = json.loads(printed.split(":", 1)[1])
    assert found.keys() == final.keys()
    for name, value in final.items():
        assert found[name] == pytest.approx(value, abs=SCORE_ATOL, rel=0), name
    main([str(run_dir), "eval.tasks=[sums_mc]", "eval.num_fewshot=0", "eval.limit=4"])
    found = json.loads(capsys.readouterr().out.split(":", 1)[1])
    assert set(found) == {"eval/sums_mc/acc", "eval/sums_mc/acc_norm"}
    assert found["eval/sums_mc/acc"] in (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.mark.parametrize(("args", "message"), [
    (["eval.tasks=[nothing]"], "Error: eval.tasks='nothing' is invalid: a task of lm-evaluation-harness under"),
    (["eval.batch_size=0"], "Error: eval.batch_size=0 is invalid: 1 or more"),
    (["trainer.devices=2"], "Error: override='trainer.devices=2' is invalid: eval.KEY=VALUE"),
], ids=["unknown-task", "batch-size", "not-eval"])
def test_the_command_line_refuses_in_one_line(setting, runs, capsys, args, message):
    from disttrain.eval.__main__ import main

    run_dir = runs("single")
    capsys.readouterr()  # the run's own output
    with pytest.raises(SystemExit) as stopped:
        main([str(run_dir), *args])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith(message) and err.count("\n") == 1, err


def test_scoring_leaves_the_runs_random_states_as_they_were():
    """Inside, the seeds ``simple_evaluate`` sets (what the harness's scores are compared under); after, Python's,
    NumPy's and torch's generators continue as if no scoring had happened (a score mid-run changes no draw of the
    run's)."""
    import random

    import numpy as np
    from lm_eval.defaults import DEFAULT_OTHER_SEED

    from disttrain.eval.scoring import seeded_as_the_harness

    def draws() -> tuple:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    def seed() -> None:
        random.seed(5), np.random.seed(5), torch.manual_seed(5)

    seed()
    expected = draws()
    seed()
    with seeded_as_the_harness():
        inside = float(torch.rand(1))
    assert draws() == expected
    torch.manual_seed(DEFAULT_OTHER_SEED)
    assert inside == float(torch.rand(1))

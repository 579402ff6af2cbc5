"""Every parallel layout through the real runner equals one process: loss curve, gradient norms, final weights.

Two families that a wrong gradient scale or norm cannot pass: plain SGD (no momentum, no clipping), where
a gradient off by a factor moves every weight by that factor, and the same with clipping that binds on
every step (the logged pre-clip norm is asserted to exceed the limit), where a wrong global norm scales
every update. Each run validates at its last step; ``last.ckpt`` must hold that step, and its exported
weights must give the run's logged validation loss in one process. Tolerances are set from the
deviations measured in fp32 (reduction order only), see ``LOSS_RTOL`` and ``WEIGHT_ATOL``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from disttrain.checkpoint.export import consolidated_weights
from disttrain.checkpoint.io import load_metadata
from disttrain.launch.job import train
from tests.conftest import compose_config, exported_val_loss, logged_metric
from tests.test_run import GPT_FAST, step_losses

STEPS, CLIP = 6, 0.5
"""Steps of every parity run (here and in the suites that reuse ``BASE``): a wrong gradient scale, norm or shard
moves the first update, which the second step's loss shows (pipeline stages' norms not added: 8.9e-3 relative;
shard-local norms under ZeRO-3: 2.7e-2), and the warm-up step (``warmup_fraction=0.1`` rounds to one step from
5 steps on) keeps the schedule's two phases in the curve."""
BASE = [*GPT_FAST, "model.n_layer=4", "model.tie_weights=false", f"trainer.max_steps={STEPS}",
        f"trainer.val_check_interval={STEPS}", "trainer.check_val_every_n_epoch=null",
        "optim=sgd", "optim.momentum=0", "optim.nesterov=false", "optim.lr=0.5"]
FAMILIES = {"sgd": ["trainer.gradient_clip_val=null"], "sgd+clip": [f"trainer.gradient_clip_val={CLIP}"]}
PIPE = ["parallel=pipeline"]
LAYOUTS = {
    "ddp": (["parallel=ddp"], 2),
    "zero1": (["parallel=zero1"], 2),
    "zero2": (["parallel=zero2"], 2),
    "zero3": (["parallel=zero3"], 2),
    "hsdp": (["parallel=hsdp"], 4),
    "tp": (["parallel=tp"], 2),
    "tp+sp": (["parallel=tp", "parallel.sequence_parallel=true"], 2),
    "dp_shard2xtp2": (["parallel=hybrid", "parallel.tp=2"], 4),
    **{f"pp-{name}": ([*PIPE, f"parallel.pipeline.schedule={name}", f"parallel.pipeline.stages_per_rank={spr}"], 2)
       for name, spr in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2), ("zbv", 2))},
    "pp2xdp_shard2": ([*PIPE, "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"], 4),
    "pp2xtp2": ([*PIPE, "parallel.pp=2", "parallel.tp=2"], 4),
    "cp2": (["parallel.cp=2"], 2),
    "cp4": (["parallel.cp=4"], 4),
    "cp2xdp_shard2": (["parallel=zero3", "parallel.dp_shard=2", "parallel.cp=2"], 4),
    "cp2xtp2+sp": (["parallel=tp", "parallel.sequence_parallel=true", "parallel.cp=2", "parallel.zero_stage=3"], 4),
    "cp2xpp2": ([*PIPE, "parallel.pp=2", "parallel.cp=2", "parallel.zero_stage=3"], 4),
}
# measured over all layouts at 10 steps (fp32, gloo; fewer steps accumulate less): losses within 2.3e-7 relative,
# pre-clip norms 4.4e-7, final weights 1.2e-7 absolute, logged vs exported validation loss 6.5e-8
LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL, VAL_RTOL = 1e-6, 1e-6, 5e-7, 5e-7


def run_summary(run_dir: Path, overrides: list[str], updates: dict | None = None) -> dict:
    """Train ``overrides`` (then ``updates``: key -> value set on the composed config) into ``run_dir``; the
    loss curve, pre-clip norms, final weights and checks."""
    cfg = compose_config(overrides, run_dir)
    for key, value in (updates or {}).items():
        OmegaConf.update(cfg, key, value, merge=False)
    train(cfg)
    last = run_dir / "checkpoints" / "last.ckpt"
    return {
        "losses": step_losses(run_dir),
        "norms": [value for _, value in logged_metric(run_dir, "train/grad_norm")],
        "val_loss": logged_metric(run_dir, "val/loss")[-1][1],
        "last_step": load_metadata(last)["global_step"],
        "weights": consolidated_weights(last),
        "exported_val_loss": exported_val_loss(run_dir, last, run_dir / "model.pt"),
    }


def single_process_runs(tmp_path_factory: pytest.TempPathFactory, overrides_of) -> Callable[[str], dict]:
    """``name -> run_summary`` of ``overrides_of(name)`` in one process, each run when first asked for (a module
    fixture's reference runs)."""
    cache: dict[str, dict] = {}

    def reference(name: str) -> dict:
        if name not in cache:
            cache[name] = run_summary(tmp_path_factory.mktemp(f"{name}-single"), overrides_of(name))
        return cache[name]

    return reference


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, dict]:
    return {family: run_summary(tmp_path_factory.mktemp("single"), [*BASE, *extra])
            for family, extra in FAMILIES.items()}


def relative_deviation(reference: list[float], other: list[float]) -> float:
    assert len(reference) == len(other) > 0, (len(reference), len(other))
    return max(abs(x - y) / abs(x) for x, y in zip(reference, other, strict=True))


def check_against(reference: dict, got: dict, clipped: bool, loss_rtol: float = LOSS_RTOL,
                  weight_atol: float = WEIGHT_ATOL, norm_rtol: float = NORM_RTOL) -> None:
    assert got["last_step"] == STEPS
    assert got["exported_val_loss"] == pytest.approx(got["val_loss"], rel=VAL_RTOL)
    assert relative_deviation(reference["losses"], got["losses"]) <= loss_rtol
    assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=loss_rtol)
    if clipped:
        assert len(got["norms"]) == STEPS and min(got["norms"]) > CLIP, got["norms"]
        assert relative_deviation(reference["norms"], got["norms"]) <= norm_rtol
    else:
        assert not got["norms"]
    assert got["weights"].keys() == reference["weights"].keys()
    for name, weight in got["weights"].items():
        torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=weight_atol, msg=name)


def test_reference_is_consistent(references):
    for family, reference in references.items():
        check_against(reference, reference, clipped=family == "sgd+clip")


SGD_FAST = ("ddp", "zero3", "tp+sp", "pp-1f1b", "cp2")
"""The layouts whose unclipped family runs in the default suite, one per kind of split. Every layout's clipped
family does: its pre-clip norms (to 1e-6), losses and weights find a gradient off by a factor or a wrong shard
as the unclipped family does; the rest of the unclipped runs are marked slow."""


@pytest.mark.parametrize(("layout", "family"), [
    pytest.param(layout, family, marks=() if family == "sgd+clip" or layout in SGD_FAST else pytest.mark.slow)
    for family in FAMILIES for layout in LAYOUTS])
def test_layout_matches_one_process(tmp_path, references, layout, family):
    overrides, ranks = LAYOUTS[layout]
    got = run_summary(tmp_path / "run", [*BASE, *FAMILIES[family], *overrides, f"trainer.devices={ranks}"])
    check_against(references[family], got, clipped=family == "sgd+clip")

"""The layouts a matrix optimiser (Muon, SOAP) is proved under through the real runner, shared by their test files:
a run under each layout equals one process (losses, pre-clip norms, final weights), and a run saved under one layout
resumes under another on the saving run's own curve. Each optimiser's test file brings its own overrides (which
optimiser, its fp32/float64 options) and tolerances."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from disttrain.launch.job import train
from tests.conftest import compose_config
from tests.test_expert_parallel import MOE_MODEL
from tests.test_parity import CLIP, PIPE, STEPS, check_against, relative_deviation, run_summary
from tests.test_parity import LAYOUTS as PARITY_LAYOUTS
from tests.test_resume_layouts import BASE as RESUME_BASE
from tests.test_resume_layouts import SAVED
from tests.test_resume_layouts import STEPS as RESUME_STEPS
from tests.test_run import GPT_FAST, step_losses

LAYOUTS = {
    **{name: PARITY_LAYOUTS[name] for name in ("ddp", "zero1", "zero2", "zero3")},
    "zero3+accumulate4": (["parallel=zero3", "batch.accumulation=4"], 2),
    **{name: PARITY_LAYOUTS[name] for name in ("hsdp", "tp", "tp+sp")},
    "tp+accumulate4": (["parallel=tp", "batch.accumulation=4"], 2),
    **{name: PARITY_LAYOUTS[name] for name in ("pp-1f1b", "cp2", "dp_shard2xtp2", "pp2xdp_shard2")},
    "pp2xtp2xdp_shard2": ([*PIPE, "parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=2", "parallel.zero_stage=3"],
                          8),
}
"""Layout name -> (overrides, ranks) of the GPT runs: the parity suite's that split matrices, accumulation 4, and
a 3-D hybrid."""
MOE_LAYOUTS = {
    "ep2": (["parallel=zero3", "parallel.ep=2"], 2),
    "ep2xtp2": (["parallel=hybrid", "parallel.tp=2", "parallel.ep=2"], 4),
}
"""Layout name -> (overrides, ranks) of the MoE runs (expert stacks split by expert)."""
HF_LAYOUTS = {
    "hf-ddp": (["parallel=ddp"], 2),
    "hf-zero3": (["parallel=zero3"], 2),
    "hf-zero3+accumulate4": (["parallel=zero3", "batch.accumulation=4"], 2),
    "hf-tp": (["parallel=tp"], 2),
}
"""Layout name -> (overrides, ranks) of the Hugging Face Llama runs (``model=hf``: transformers' own projections,
grouped-query k/v narrower than q, sharded by FSDP2 and by the config's own tensor-parallel plan)."""
RESUME_LAYOUTS = {"single": ([], 1), **LAYOUTS}
"""The layouts a resumed run may save or resume under: one process too."""


def base(optim: list[str]) -> list[str]:
    """The GPT runs' overrides (2 layers, clipping that binds, one validation at the end) with ``optim``'s."""
    return [*GPT_FAST, "model.n_layer=2", "model.tie_weights=false", f"trainer.max_steps={STEPS}",
            f"trainer.val_check_interval={STEPS}", "trainer.check_val_every_n_epoch=null",
            f"trainer.gradient_clip_val={CLIP}", *optim]


def moe_base(gpt: list[str]) -> list[str]:
    """``gpt`` (a ``base``) with the MoE model in place of GPT."""
    return [*(o for o in gpt if not o.startswith("model")), *MOE_MODEL]


def hf_base(gpt: list[str]) -> list[str]:
    """``gpt`` (a ``base``) with a tiny Hugging Face Llama (``tests/test_hf_models.TINY``) in place of GPT."""
    from tests.test_hf_models import TINY

    return [*(o for o in gpt if not o.startswith("model")), "model=hf", "model.arch=llama",
            *(f"+model.{key}={value}" for key, value in TINY.items())]


def runs_of(model: str, gpt: list[str], moe: list[str]) -> list[str]:
    """The overrides of ``model``'s runs: gpt (``gpt``), moe (``moe``) or hf (``hf_base(gpt)``)."""
    return gpt if model == "gpt" else moe if model == "moe" else hf_base(gpt)


def layout_params(fast: tuple[str, ...]) -> list:
    """Every layout as a pytest parameter, those not in ``fast`` marked slow."""
    return [pytest.param(name, marks=() if name in fast else pytest.mark.slow) for name in [*LAYOUTS, *MOE_LAYOUTS]]


def one_process_runs(tmp_path_factory: pytest.TempPathFactory, gpt: list[str],
                     moe: list[str] | None = None) -> Callable[[str, int], dict]:
    """``(model, accumulation) -> run_summary`` of one process (``model``: gpt; moe: ``moe``'s overrides, by
    default ``moe_base(gpt)``; hf: ``hf_base(gpt)``), each run when first asked for (a module fixture's
    references)."""
    cache: dict[tuple[str, int], dict] = {}
    moe = moe_base(gpt) if moe is None else moe

    def reference(model: str, accumulation: int) -> dict:
        if (model, accumulation) not in cache:
            overrides = [*runs_of(model, gpt, moe), f"batch.accumulation={accumulation}"]
            cache[model, accumulation] = run_summary(tmp_path_factory.mktemp(f"{model}-{accumulation}"), overrides)
        return cache[model, accumulation]

    return reference


def deviations(reference: dict, got: dict) -> dict[str, float]:
    """The largest relative deviation of the losses and pre-clip norms and absolute one of the final weights."""
    return {"losses": relative_deviation(reference["losses"], got["losses"]),
            "norms": relative_deviation(reference["norms"], got["norms"]),
            "weights": max((w - reference["weights"][n]).abs().max().item() for n, w in got["weights"].items())}


def check_layout(tmp_path: Path, references: Callable[[str, int], dict], gpt: list[str], layout: str,
                 loss_rtol: float, norm_rtol: float, weight_atol: float,
                 moe: list[str] | None = None) -> dict[str, float]:
    """Run ``layout`` (of the GPT runs ``gpt``, the MoE runs ``moe``, by default ``moe_base(gpt)``, or the Hugging
    Face runs ``hf_base(gpt)``) and check it against one process at these tolerances; with accumulation 4, against
    one process at accumulation 1 too (the same global batches in one micro-batch: the same curve and weights; the
    validation batches differ, being micro-batch sized). Returns the deviations from one process."""
    model = "moe" if layout in MOE_LAYOUTS else "hf" if layout in HF_LAYOUTS else "gpt"
    overrides, ranks = {**LAYOUTS, **MOE_LAYOUTS, **HF_LAYOUTS}[layout]
    accumulation = 4 if "batch.accumulation=4" in overrides else 1
    runs = runs_of(model, gpt, moe_base(gpt) if moe is None else moe)
    got = run_summary(tmp_path / "run", [*runs, *overrides, f"trainer.devices={ranks}"])
    reference = references(model, accumulation)
    check_against(reference, got, clipped=True, loss_rtol=loss_rtol, weight_atol=weight_atol, norm_rtol=norm_rtol)
    if accumulation > 1:
        single = references(model, 1)
        assert relative_deviation(single["losses"], got["losses"]) <= loss_rtol
        assert relative_deviation(single["norms"], got["norms"]) <= norm_rtol
        for name, weight in got["weights"].items():
            torch.testing.assert_close(weight, single["weights"][name], rtol=0, atol=weight_atol, msg=name)
    return deviations(reference, got)


def resume_base(optim: list[str]) -> list[str]:
    """The resumed runs' overrides (``test_resume_layouts``'s, 2 layers) with ``optim``'s."""
    return [*(o for o in RESUME_BASE if not o.startswith(("optim", "model.n_layer"))), "model.n_layer=2", *optim]


def resume_deviation(tmp_path: Path, overrides: list[str], before: str, after: str) -> float:
    """A run of ``overrides`` saved under ``before`` and resumed at its save point under ``after``: the resumed
    steps' largest relative deviation from the saving run's own curve."""
    def layout(name: str) -> list[str]:
        extra, ranks = RESUME_LAYOUTS[name]
        return [*extra, f"trainer.devices={ranks}"]

    train(compose_config([*overrides, *layout(before)], tmp_path / "saved"))
    curve = step_losses(tmp_path / "saved")
    assert len(curve) == RESUME_STEPS
    point = saved_point(tmp_path / "saved")
    train(compose_config([*overrides, *layout(after), f"resume={point}"], tmp_path / "resumed"))
    resumed = step_losses(tmp_path / "resumed")[-(RESUME_STEPS - SAVED):]
    assert len(resumed) == RESUME_STEPS - SAVED
    return relative_deviation(curve[SAVED:], resumed)


def saved_point(run_dir: Path) -> Path:
    """The checkpoint a resumed run starts from: the saving run's of step ``SAVED``."""
    return run_dir / "checkpoints" / f"last-step{SAVED}.ckpt"

"""With masked targets (``IGNORE_INDEX``), a step's loss is the mean over every real target of its global batch under
every layout: losses, pre-clip gradient norms and final weights equal one process holding the whole batch in one
micro-batch (whose loss is ``F.cross_entropy``'s own mean over the batch's real targets).

The data makes the real targets uneven by construction: each sample's real targets are one span of its own length
and place (some samples have none, many lie in one half of the sequence only), so micro-batches, pipeline
microbatches and context-parallel shards hold different numbers of them, some none at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disttrain.data.base import IGNORE_INDEX
from tests.test_parity import relative_deviation, run_summary

VOCAB, BLOCK, SAMPLES = 64, 32, 96


def masked_tokens(count: int = SAMPLES) -> dict:
    """Token windows whose targets are real on one span each (``tests.test_target_mean.masked_tokens`` as
    ``data._target_``)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (count, BLOCK + 1), generator=generator)
    samples = []
    for k in range(count):
        targets = torch.full((BLOCK,), IGNORE_INDEX)
        start = (5 * k) % 24
        end = 0 if k % 9 == 0 else min(BLOCK, start + 1 + (11 * k) % 20)
        targets[start:end] = tokens[k, 1 + start:1 + end]
        samples.append((tokens[k, :BLOCK], targets))
    return {"train": samples[:80], "val": samples[80:88], "vocab_size": VOCAB}


STEPS, CLIP = 4, 100.0
BASE = ["model=gpt", "model.flavour=micro", "model.n_layer=2", "model.tie_weights=false", "data=custom",
        "data._target_=tests.test_target_mean.masked_tokens", "batch.global_size=8", f"trainer.max_steps={STEPS}",
        f"trainer.val_check_interval={STEPS}", "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=8",
        "trainer.log_every_n_steps=1", "trainer.run_test=false", "logger=csv", "callbacks=none",
        "scheduler.warmup_fraction=0", "optim=sgd", "optim.momentum=0", "optim.nesterov=false", "optim.lr=0.5",
        f"trainer.gradient_clip_val={CLIP}"]
"""Clipping far above the norms: the pre-clip norm is logged every step and never changes the update."""
LAYOUTS = {
    "ddp": ["parallel=ddp", "trainer.devices=2"],
    "accumulation4": ["batch.accumulation=4"],
    "zero3+accumulation2": ["parallel=zero3", "trainer.devices=2", "batch.accumulation=2"],
    "pp-1f1b": ["parallel=pipeline", "parallel.pipeline.schedule=1f1b", "trainer.devices=2"],
    "cp2": ["parallel.cp=2", "trainer.devices=2"],
    "tp": ["parallel=tp", "trainer.devices=2"],
    "param_server": ["parallel=param_server", "trainer.devices=2"],
}
UNSEEN_NORMS = {"param_server"}
"""Layouts whose averaged gradients only the servers hold: they clip them, and no norm is logged."""
# measured (fp32, gloo, all layouts and torchft): losses within 1.2e-7 relative, pre-clip norms 7.4e-8, final
# weights 3e-8 absolute
LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-6, 1e-6, 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_summary(tmp_path_factory.mktemp("single") / "run", BASE)


def test_the_data_is_uneven_by_construction():
    samples = masked_tokens()["train"]
    real = torch.stack([targets != IGNORE_INDEX for _, targets in samples])
    per_sample = real.sum(dim=1)
    assert per_sample.min() == 0 and per_sample.max() > 4 * max(1, int(per_sample[per_sample > 0].min()))
    chunk = BLOCK // 4  # under cp=2 rank 0 holds chunks 0 and 3 of every sequence, rank 1 chunks 1 and 2
    shards = torch.stack([real[:, :chunk].sum(1) + real[:, 3 * chunk:].sum(1), real[:, chunk:3 * chunk].sum(1)], 1)
    assert ((shards[:, 0] > 0) & (shards[:, 1] == 0)).any() and ((shards[:, 1] > 0) & (shards[:, 0] == 0)).any()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_masked_targets_give_one_process_mean_under_every_layout(tmp_path: Path, reference, layout):
    got = run_summary(tmp_path / "run", [*BASE, *LAYOUTS[layout]])
    norms = reference["norms"] if layout in UNSEEN_NORMS else got["norms"]
    assert got["last_step"] == STEPS and len(got["losses"]) == len(norms) == STEPS
    weight_error = max(float((w - reference["weights"][n]).abs().max()) for n, w in got["weights"].items())
    print(f"{layout}: losses {relative_deviation(reference['losses'], got['losses']):.1e} relative, norms "
          f"{relative_deviation(reference['norms'], norms):.1e} relative, weights {weight_error:.1e} absolute")
    assert relative_deviation(reference["losses"], got["losses"]) <= LOSS_RTOL
    assert relative_deviation(reference["norms"], norms) <= NORM_RTOL
    assert got["val_loss"] == pytest.approx(reference["val_loss"], rel=LOSS_RTOL)
    assert got["weights"].keys() == reference["weights"].keys()
    for name, weight in got["weights"].items():
        torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=WEIGHT_ATOL, msg=name)


def _step_and_replica_means(sums: list[float], real: list[int]) -> tuple[float, ...]:
    """On each rank: one micro-batch of 8 target positions with ``real[rank]`` real ones and loss sum
    ``sums[rank]``; the step's ``(loss, factor)`` under both scopes."""
    import torch.distributed as dist

    from disttrain.fault.steps import StepAgreement
    from disttrain.rank.target_mean import StepTargets

    rank = dist.get_rank()
    targets = torch.full((2, 4), IGNORE_INDEX)
    targets.view(-1)[:real[rank]] = 1
    values = []
    for scope in ("step", "replica"):
        counted = StepTargets(scope)
        counted.add(torch.tensor(sums[rank]), targets)
        values += [float(v) for v in counted.take(StepAgreement(), dist.get_world_size(), torch.device("cpu"))]
    return tuple(values)


def test_a_step_is_the_mean_over_all_ranks_targets_and_a_replica_over_its_own_with_none_divided_by_zero():
    from tests.dist_utils import run_on_ranks

    # rank 1 holds no real target: its share adds nothing, and alone it divides by one, not zero
    ranks = run_on_ranks(_step_and_replica_means, 2, [6.0, 0.0], [3, 0])
    for step_loss, step_factor, replica_loss, _ in ranks:
        assert step_loss == pytest.approx(6.0 / 3) and step_factor == pytest.approx(16 / 3)
        assert replica_loss == pytest.approx((6.0 / 3 + 0.0) / 2)  # the replicas' own means, averaged for the log
    assert [r[3] for r in ranks] == pytest.approx([8 / 3, 8.0])


def test_torchft_groups_take_the_mean_over_the_real_targets_of_all_groups(tmp_path: Path, reference):
    pytest.importorskip("torchft")
    from disttrain.checkpoint.export import consolidated_weights
    from tests.conftest import ROOT, logged_metric, train_cli_in_process
    from tests.test_run import step_losses

    run_dir = tmp_path / "torchft"
    done = train_cli_in_process([*BASE, "parallel=ddp", "trainer.devices=2", "fault_tolerance.engine=torchft",
                                 "fault_tolerance.min_groups=2", "plots=false", f"hydra.run.dir={run_dir}"], ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    losses, norms = step_losses(run_dir), [value for _, value in logged_metric(run_dir, "train/grad_norm")]
    weights = consolidated_weights(run_dir / "checkpoints" / "last.ckpt")
    weight_error = max(float((w - reference["weights"][n]).abs().max()) for n, w in weights.items())
    print(f"torchft: losses {relative_deviation(reference['losses'], losses):.1e} relative, norms "
          f"{relative_deviation(reference['norms'], norms):.1e} relative, weights {weight_error:.1e} absolute")
    assert relative_deviation(reference["losses"], losses) <= LOSS_RTOL
    assert relative_deviation(reference["norms"], norms) <= NORM_RTOL
    assert weight_error <= WEIGHT_ATOL

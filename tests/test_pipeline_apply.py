"""Pipeline parallelism: stage cutting, config checks, and parity of every schedule with one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from disttrain.errors import ConfigError
from disttrain.models.gpt import GPT, GPTDims
from disttrain.parallel.model_plan import pipeline_units_of
from disttrain.parallel.pipeline.split import (
    SCHEDULES,
    build_schedule,
    build_stage_module,
    build_stages,
    check_pipeline,
    check_units,
    split_points,
    stage_indices,
    unit_split_points,
)
from tests.dist_utils import run_on_ranks

DIMS = GPTDims(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=64)
STEPS, BATCH, MICROBATCHES, LR = 5, 8, 4, 3e-3
# measured (fp32, gloo, every schedule): losses within 1.2e-7 relative, first-step gradients within 1.9e-8
# absolute; the gradients are compared because AdamW hides a gradient scale from the losses
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-7
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(DIMS, dropout=0.0, tie_weights=False)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, DIMS.vocab_size, (BATCH, DIMS.block_size + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Microbatch mean cross-entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step, (x, y) in enumerate(_batches()):
        loss = _loss_fn(model(x), y)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _pipeline_run(schedule: str) -> tuple[list[float], dict]:
    rank, pp = dist.get_rank(), dist.get_world_size()
    stages, modules = build_stages(_model, rank, pp, STAGES_PER_RANK[schedule], schedule, torch.device("cpu"))
    sched = build_schedule(schedule, stages, MICROBATCHES, _loss_fn)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    has_last = any(s.is_last for s in stages)
    losses, grads = [], {}
    for step, (x, y) in enumerate(_batches()):
        mb_losses: list[torch.Tensor] = []
        sched.step(x, target=y, losses=mb_losses)
        local = torch.stack(mb_losses).mean() if has_last else torch.zeros(())
        dist.all_reduce(local)  # only the rank with the last stage contributes
        if step == 0:
            # numpy arrays: torch tensors would travel through shared memory that dies with the rank
            grads = {n: p.grad.numpy().copy() for m in modules for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(local.item())
    return losses, grads


def _all_schedules() -> dict[str, tuple[list[float], dict]]:
    return {name: _pipeline_run(name) for name in SCHEDULES}


def test_every_schedule_matches_one_process() -> None:
    results = run_on_ranks(_all_schedules, 2, timeout=90)
    ref_losses, ref_grads = _reference()
    for name in SCHEDULES:
        losses = [results[r][name][0] for r in range(2)]
        assert losses[0] == losses[1], name
        torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        grads = {k: torch.from_numpy(v) for r in range(2) for k, v in results[r][name][1].items()}
        assert set(grads) == set(ref_grads), name
        assert len(results[0][name][1]) + len(results[1][name][1]) == len(ref_grads), name  # disjoint stages
        for key, ref in ref_grads.items():
            torch.testing.assert_close(grads[key], ref, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       msg=lambda m, name=name, key=key: f"{name} {key}: {m}")


def test_split_points_balanced_and_explicit() -> None:
    assert split_points(4, 2) == [0, 2]
    assert split_points(8, 4) == [0, 2, 4, 6]
    assert split_points(5, 1) == [0]
    # A heavy first unit (an embedding) pushes the others to the later stages.
    assert split_points(5, 2, [20, 10, 10, 10, 10]) == [0, 2]
    assert split_points(5, 2, [10, 10, 10, 10, 20]) == [0, 3]
    assert split_points(6, 3, [1, 1, 1, 1, 1, 1]) == [0, 2, 4]
    assert split_points(4, 2, explicit=[3]) == [0, 3]
    assert split_points(4, 3, explicit=[0, 1, 2]) == [0, 1, 2]
    with pytest.raises(ConfigError, match="at most 4 stages"):
        split_points(4, 5)
    for stages, bad in ((2, [0]), (2, [4]), (3, [2, 2]), (2, [1, 2, 3])):
        with pytest.raises(ConfigError, match="strictly increasing"):
            split_points(4, stages, explicit=bad)


def test_unit_split_points_count_embedding_and_head() -> None:
    model = GPT(GPTDims(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=4096), tie_weights=False)
    units = pipeline_units_of(model)
    assert units == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head"]
    # The embedding and the head (4096 x 32 each) outweigh a block (about 12.7k parameters): the first and
    # the last stage get fewer blocks.
    assert unit_split_points(model, units, 2) == [0, 3]
    assert unit_split_points(model, units, 3) == [0, 1, 5]  # embedding | all blocks | norm and head
    assert unit_split_points(model, units, 2, explicit=[1]) == [0, 1]


def test_stage_modules_keep_full_names_and_refuse_tied_weights() -> None:
    model = _model()
    full = dict(model.named_parameters())
    units = pipeline_units_of(model)
    stages = [build_stage_module(_model(), units, i, [0, 3]) for i in range(2)]
    names = [set(dict(s.named_parameters())) for s in stages]
    assert names[0] | names[1] == set(full) and not names[0] & names[1]
    assert "embed.wte.weight" in names[0] and "blocks.1.attn.q.weight" in names[0] and "lm_head.weight" in names[1]
    assert "blocks.3.mlp.fc.weight" in names[1] and "blocks.2.ln_1.weight" not in names[0]
    x = torch.randint(0, DIMS.vocab_size, (2, DIMS.block_size))
    torch.testing.assert_close(stages[1](stages[0](x)), model(x))
    tied = GPT(DIMS, tie_weights=True)
    with pytest.raises(ConfigError, match="lm_head.weight is embed.wte.weight.*tie_weights=false"):
        check_units(tied, pipeline_units_of(tied), 2, "gpt")


def test_stage_indices() -> None:
    assert stage_indices(0, 2, 1) == [0]
    assert stage_indices(1, 4, 2) == [1, 5]
    assert stage_indices(0, 2, 2, "v") == [0, 3]
    assert stage_indices(1, 2, 2, "v") == [1, 2]
    with pytest.raises(ConfigError):
        stage_indices(0, 2, 3, "v")


@pytest.mark.parametrize(("args", "key"), [
    (("pipedream", 2, 1, 4, 8, 4), "schedule"),
    (("gpipe", 2, 2, 4, 8, 8), "stages_per_rank"),
    (("1f1b", 2, 2, 4, 8, 8), "stages_per_rank"),
    (("zbv", 2, 1, 4, 8, 8), "stages_per_rank"),
    (("zbv", 2, 3, 6, 12, 8), "stages_per_rank"),
    (("1f1b", 4, 1, 2, 8, 8), "microbatches"),
    (("zbv", 2, 2, 3, 9, 8), "microbatches"),
    (("interleaved_1f1b", 2, 2, 7, 14, 8), "microbatches"),
    (("gpipe", 2, 1, 3, 8, 4), "microbatches"),
    (("interleaved_1f1b", 2, 2, 4, 8, 3), "parallel.pp"),
    (("gpipe", 8, 1, 8, 8, 4), "parallel.pp"),
])
def test_check_pipeline_refuses(args: tuple, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        check_pipeline(*args)


def test_check_pipeline_accepts() -> None:
    for name, spr in STAGES_PER_RANK.items():
        check_pipeline(name, 2, spr, 4, 8, 4)
    check_pipeline("gpipe", 4, 1, 2, 8, 4)  # GPipe runs with fewer microbatches than stages

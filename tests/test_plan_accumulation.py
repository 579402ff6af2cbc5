"""Gradient accumulation under ZeRO-2/3 (``parallel.accumulate_grads``): the gradient bytes a rank holds
between micro-batches and the bytes it sends match the plan for each option, and both options train alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain.data.spec import DataSpec
from disttrain.parallel.config import ParallelConfig
from disttrain.plan.hardware import PROFILES
from disttrain.plan.layout import Layout
from tests.dist_utils import run_on_ranks
from tests.test_plan import TEXT, _inputs, _model, _zero_memory_benchmark

ACCUMULATION, ACC_STEPS, ACC_MICRO = 4, 2, 2
ACC_DIMS = (2, 4, 128, 32, 256)  # GPTDims: every width divides by the ranks, so FSDP2 pads nothing


def _accumulated_grads_rank(modes: list[str], replicas: int) -> dict:
    """ZeRO-3 over all ranks (hybrid sharding with ``replicas`` > 1), ``ACC_STEPS`` SGD steps of
    ``ACCUMULATION`` micro-batches under each ``parallel.accumulate_grads`` mode, as the strategy runs them: per
    mode, the bytes of gradient tensors this rank holds after the first (non-final) micro-batch's backward, the
    bytes its collectives sent in the first step, the losses and the final weights; and one process's losses
    and weights on the same global batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from disttrain.models.gpt import GPT, GPTDims
    from disttrain.parallel.apply import backward_sync_disabled
    from disttrain.parallel.fsdp import apply_fsdp

    bench = _zero_memory_benchmark()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    dims = GPTDims(*ACC_DIMS)
    gen = torch.Generator().manual_seed(7)
    steps = [torch.randint(0, dims.vocab_size, (world * ACCUMULATION * ACC_MICRO, dims.block_size + 1),
                           generator=gen) for _ in range(ACC_STEPS)]

    def loss_of(net, rows: torch.Tensor) -> torch.Tensor:
        logits = net(rows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, dims.vocab_size), rows[:, 1:].reshape(-1))

    def held_grads(model: torch.nn.Module) -> int:
        """Every gradient tensor FSDP2 keeps: the shards' ``grad`` and, while accumulating unsharded, the whole
        gradient on each unsharded parameter (or its upcast copy), and hybrid sharding's partial reduction."""
        tensors = [p.grad for p in model.parameters()]
        for module in model.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is not None:
                tensors.append(group._partial_reduce_output)
                for param in group.fsdp_params:
                    tensors.append(param.unsharded_accumulated_grad)
                    if hasattr(param, "_unsharded_param"):
                        tensors.append(param._unsharded_param.grad)
        return bench.held_bytes(tensors)

    out = {}
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("dp_replicate", "dp_shard"))
    for mode in modes:
        torch.manual_seed(0)
        model = apply_fsdp(GPT(dims), mesh, reshard_after_forward=True)
        sharded = ParallelConfig(zero_stage=3, accumulate_grads=mode).sharded_accumulation
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, held, sent = [], None, None
        for step, batch in enumerate(steps):
            mine = batch.chunk(world)[rank].chunk(ACCUMULATION)
            total = torch.zeros(())
            with bench.CommCounter() as counter:
                for i, micro in enumerate(mine):
                    if i < ACCUMULATION - 1:
                        with backward_sync_disabled(model, sharded):
                            loss = loss_of(model, micro)
                            (loss / ACCUMULATION).backward()
                    else:
                        loss = loss_of(model, micro)
                        (loss / ACCUMULATION).backward()
                    total += loss.detach() / ACCUMULATION
                    if step == 0 and i == 0:
                        held = held_grads(model)
            sent = counter.bytes if step == 0 else sent
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.distributed.all_reduce(total)
            losses.append(total.item() / world)
        weights = {name: p.full_tensor() for name, p in model.named_parameters()}
        out[mode] = {"held": held, "sent": sent, "losses": losses, "weights": weights}
    torch.manual_seed(0)
    single = GPT(dims)
    opt = torch.optim.SGD(single.parameters(), lr=0.5)
    losses = []
    for batch in steps:
        loss = loss_of(single, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out["single"] = {"losses": losses, "weights": {name: p.detach() for name, p in single.named_parameters()}}
    return out


@pytest.mark.parametrize(("world", "replicas", "modes"), [(2, 1, ["auto", "sharded", "unsharded"]),
                                                         (4, 2, ["sharded", "unsharded"])], ids=["zero3", "hsdp"])
def test_accumulated_gradients_per_rank_match_the_plan_and_both_modes_train_alike(world: int, replicas: int,
                                                                                  modes: list[str]) -> None:
    """ZeRO-3 on 2 gloo ranks and hybrid sharding (2 replicas x 2) on 4, 4 micro-batches per step: after a
    non-final micro-batch's backward each rank holds its gradient shard (sharded, auto) or whole gradients
    (unsharded), byte for byte what the plan says, and its collectives sent what the plan says; every mode's
    losses and weights equal one process's."""
    from disttrain.models.gpt import GPT, GPTDims

    ranks = run_on_ranks(_accumulated_grads_rank, world, modes, replicas, timeout=240)
    with torch.device("meta"):
        net = GPT(GPTDims(*ACC_DIMS))
    inputs = _inputs(net, DataSpec("text", vocab_size=ACC_DIMS[4], block_size=ACC_DIMS[3]), ACC_MICRO)
    reference = ranks[0]["single"]
    for mode in modes:
        layout = Layout(dp_replicate=replicas, dp_shard=world // replicas, zero_stage=3, micro_size=ACC_MICRO,
                        accumulation=ACCUMULATION, accumulate_grads=mode)
        predicted = inputs.estimate(layout)
        whole = inputs.stats.params * inputs.state.grad
        assert predicted.memory["grads"] == (whole if mode == "unsharded" else whole / layout.dp_shard)
        for rank in ranks:
            assert rank[mode]["held"] == predicted.memory["grads"], (mode, rank[mode]["held"])
            assert rank[mode]["sent"] == sum(c.sent_bytes for c in predicted.collectives), (
                mode, rank[mode]["sent"], [(c.kind, c.calls, c.sent_bytes) for c in predicted.collectives])
        got = ranks[0][mode]
        # measured: losses within 8.6e-8 relative of one process, weights within 6e-8 absolute (unsharded; 7.5e-9
        # sharded)
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        for name, weight in got["weights"].items():
            torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=5e-7, msg=name)


def test_the_plan_shows_which_accumulation_it_priced() -> None:
    from disttrain.plan.report import render

    net = _model({"name": "gpt", "flavour": "nano"}, TEXT)
    inputs = _inputs(net, TEXT, 4)
    sharded = inputs.estimate(Layout(dp_shard=4, zero_stage=3, micro_size=4, accumulation=4))
    unsharded = inputs.estimate(Layout(dp_shard=4, zero_stage=3, micro_size=4, accumulation=4,
                                       accumulate_grads="unsharded"))
    assert sharded.grads_alternative == unsharded.memory["grads"] == 4 * sharded.memory["grads"]
    scatter = {e.layout.accumulate_grads: next(c for c in e.collectives if c.kind == "reduce_scatter")
               for e in (sharded, unsharded)}
    assert (scatter["auto"].calls, scatter["unsharded"].calls) == (4, 1)
    assert scatter["auto"].sent_bytes == 4 * scatter["unsharded"].sent_bytes
    text = render(sharded, PROFILES["h100_sxm"], inputs.stats.params, "gpt")
    whole = f"{unsharded.memory['grads'] / 1e6:.3g} MB"
    assert f"accumulated sharded: a reduce-scatter every micro-batch; unsharded: {whole}" in text
    assert "accumulated unsharded: one reduce-scatter per step" in render(unsharded, PROFILES["h100_sxm"],
                                                                          inputs.stats.params, "gpt")

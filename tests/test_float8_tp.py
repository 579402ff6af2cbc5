"""``trainer.fp8`` under tensor parallelism: a micro GPT's tensorwise float8 layers take torchao's float8 styles and
train on 2 gloo ranks (tp=2, and tp=2 with sequence parallelism) as one float8 process does.

Both sides scale each float8 tensor by the amax of the whole tensor: a sharded weight's and an activation's amax is
a reduction over the tp ranks (DTensor), and under column-wise splits the activations are replicated. What differs
is where the gradient is cast: torchao's styles cast the gradient reaching a float8 layer's output before the
layer's bias reads it, so the biases' gradients are summed from e5m2 values (2 mantissa bits) where one process sums
them in fp32. Losses, pre-clip gradient norms and final weights therefore agree to a measured tolerance, not to the
last bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from disttrain.models.gpt import GPT, GPTDims
from disttrain.parallel.float8 import Float8Layers, choose_float8_layers, convert_to_float8
from disttrain.parallel.tp import apply_tp, float8_styled
from tests.dist_utils import run_on_ranks

pytest.importorskip("torchao")

DIMS = GPTDims(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
STEPS, BATCH, LR = 4, 8, 0.5
# measured over 4 SGD steps (tensorwise, fp32, gloo), tp / tp+sp: losses 4.0e-5 / 6.2e-6 relative, pre-clip norms
# 1.3e-3 / 1.5e-4 relative, weights 8.7e-4 / 1.7e-4 and the float8 layers' biases 5.3e-3 / 2.3e-4 absolute (under
# sequence parallelism the row-wise layers keep plain styles, so fewer biases read an e5m2 gradient); the bounds
# leave room for other CPUs
LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL, BIAS_ATOL = 5e-4, 1e-2, 5e-3, 3e-2


def float8_gpt(recipe: str) -> tuple[GPT, Float8Layers]:
    """The micro GPT with its layers swapped as a run decides them (the head stays in fp32)."""
    torch.manual_seed(0)
    net = GPT(DIMS, dropout=0.0)
    layers, _ = choose_float8_layers(net, recipe, None, False, shards_parameters=False, precision="32-true")
    convert_to_float8(net, layers)
    return net, layers


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def train(net: nn.Module) -> dict:
    """Per-step losses and pre-clip gradient norms, and the final weights, of STEPS SGD steps on fixed batches."""
    # SGD: a weight moves by its gradient, so a weight gap is a gradient gap (AdamW would turn the noise on a zero
    # gradient into a full step)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    for _ in range(STEPS):
        rows = torch.randint(0, DIMS.vocab_size, (BATCH, DIMS.block_size + 1), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(rows[:, :-1]).reshape(-1, DIMS.vocab_size), rows[:, 1:].reshape(-1))
        loss.backward()
        norms.append(torch.stack([full(p.grad).square().sum() for p in net.parameters()]).sum().sqrt().item())
        opt.step()
        losses.append(loss.item())
    # numpy arrays pickle by value (tensors would be shared through this process's file descriptors)
    return {"losses": losses, "norms": norms, "weights": {n: full(p).numpy() for n, p in net.named_parameters()}}


def _tp_worker(recipe: str, sequence_parallel: bool) -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    net, layers = float8_gpt(recipe)
    apply_tp(net, mesh, net.tp_plan(), sequence_parallel, layers)
    return train(net)


def test_tensorwise_float8_layers_take_float8_styles_and_the_rest_plain_ones():
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    net, layers = float8_gpt("tensorwise")
    entries = {"blocks.0.attn.q": "colwise", "blocks.0.attn.proj": "rowwise", "blocks.0.attn": "sequence_gather",
               "lm_head": "sequence_gather"}
    assert float8_styled(entries, layers, False) == {"blocks.0.attn.q", "blocks.0.attn.proj"}
    # with sequence parallelism torchao's row-wise style gathers a float8 gradient, which a CPU cannot concatenate
    assert float8_styled(entries, layers, True) == {"blocks.0.attn.q"}
    # rowwise scales are per row: torch's plain styles; no float8 layer, no float8 style
    assert float8_styled(entries, float8_gpt("rowwise")[1], False) == set()
    assert float8_styled(entries, None, False) == set()
    from disttrain.parallel.float8_tp import float8_style

    assert type(float8_style("colwise", False, False)) is Float8ColwiseParallel
    assert type(float8_style("rowwise", False, True)) is Float8RowwiseParallel


def assert_matches(got: dict, want: dict, layers: tuple[str, ...], what: str, float8_styles: bool = True) -> None:
    """``got`` (a tp rank's) against ``want`` (one process's) within the measured bounds; ``float8_styles``: the float8
    layers took torchao's styles, whose e5m2 bias gradients must show."""
    loss_gap = max(abs(a - b) / b for a, b in zip(got["losses"], want["losses"], strict=True))
    norm_gap = max(abs(a - b) / b for a, b in zip(got["norms"], want["norms"], strict=True))
    gaps = {n: float(abs(torch.from_numpy(got["weights"][n]) - torch.from_numpy(w)).max())
            for n, w in want["weights"].items()}
    weight_gap = max(gap for n, gap in gaps.items() if n.rsplit(".", 1)[0] not in layers or n.endswith(".weight"))
    bias_gap = max(gap for n, gap in gaps.items() if n.rsplit(".", 1)[0] in layers and n.endswith(".bias"))
    print(f"{what}: losses {loss_gap:.2e}, pre-clip norms {norm_gap:.2e}, weights {weight_gap:.2e}, "
          f"float8 layers' biases {bias_gap:.2e}")
    assert all(torch.isfinite(torch.tensor(got["losses"] + got["norms"]))), got
    assert loss_gap < LOSS_RTOL and norm_gap < NORM_RTOL and weight_gap < WEIGHT_ATOL, (loss_gap, norm_gap, weight_gap)
    assert bias_gap < BIAS_ATOL, bias_gap
    if float8_styles:  # torch's plain styles on these layers match one process to fp32 rounding (1.7e-8 measured)
        assert bias_gap > 1e-5, f"the biases match one process to {bias_gap:.1e}: torchao's float8 styles are not on"


@pytest.mark.parametrize("sequence_parallel", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tp", "tp+sp"])
def test_tensorwise_float8_under_tp_trains_as_one_float8_process(sequence_parallel):
    reference = train(float8_gpt("tensorwise")[0])
    ranks = run_on_ranks(_tp_worker, 2, "tensorwise", sequence_parallel)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    assert_matches(ranks[0], reference, float8_gpt("tensorwise")[1].modules, f"tensorwise tp=2 sp={sequence_parallel}")


@pytest.mark.slow
def test_rowwise_float8_under_tp_keeps_plain_styles_and_trains_as_one_float8_process():
    reference = train(float8_gpt("rowwise")[0])
    ranks = run_on_ranks(_tp_worker, 2, "rowwise", False)
    # a row-wise split layer's rows of input are halves on each rank, each scaled by its own half's largest value:
    # measured losses 1.1e-5 and pre-clip norms 5.8e-4 relative, weights 3.8e-4 and biases 6.1e-4 absolute
    assert_matches(ranks[0], reference, float8_gpt("rowwise")[1].modules, "rowwise tp=2", float8_styles=False)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", ["false", "true"])
def test_a_tp_float8_run_follows_the_one_process_float8_run(make_config, tmp_path, sequence_parallel):
    from tests.test_float8 import fp8_curve

    one = fp8_curve(make_config, tmp_path / "single", "trainer.fp8=tensorwise")
    tp = fp8_curve(make_config, tmp_path / "tp", "trainer.fp8=tensorwise", "parallel=tp", "trainer.devices=2",
                   f"parallel.sequence_parallel={sequence_parallel}")
    gap = ((tp - one).abs() / one).amax(dim=1)
    # measured over 8 steps (the runner's AdamW and clipping): losses 1.5e-5 / 1.8e-5, pre-clip norms 3.0e-3 / 8.6e-4
    # relative (tp / tp+sp)
    print(f"runner tp=2 sp={sequence_parallel}: losses {gap[0]:.2e}, pre-clip norms {gap[1]:.2e}")
    assert torch.isfinite(tp).all() and gap[0] < LOSS_RTOL and gap[1] < NORM_RTOL, gap


def test_an_hf_llamas_declared_plan_names_its_float8_layers():
    """The HF model's plan names its layers as the float8 decision does, so they take torchao's styles."""
    from disttrain.data.spec import DataSpec
    from disttrain.models.hf import HFConfig, build_hf
    from disttrain.parallel.model_plan import matching_modules
    from tests.test_hf_models import TINY

    net = build_hf(HFConfig(arch="llama", fields=TINY), DataSpec("text", vocab_size=256, block_size=32))
    layers, _ = choose_float8_layers(net, "tensorwise", None, False, shards_parameters=False, precision="32-true")
    entries = {name: style for pattern, style in net.tp_plan().items() for name in matching_modules(net, pattern)}
    styled = float8_styled(entries, layers, False)
    assert styled == set(layers.modules) and len(styled) == 14, sorted(styled)


@pytest.mark.slow
def test_an_hf_llama_float8_run_under_tp_follows_one_process(make_config, tmp_path):
    from disttrain.launch.job import train as train_run
    from tests.test_hf_models import TINY, hf_overrides
    from tests.test_run import step_losses

    def losses(run_dir, *extra: str) -> torch.Tensor:
        train_run(make_config([*hf_overrides("llama", TINY), "trainer.max_steps=6", "trainer.limit_val_batches=0",
                               "trainer.fp8=tensorwise", *extra], run_dir))
        return torch.tensor(step_losses(run_dir), dtype=torch.float64)

    one, tp = losses(tmp_path / "single"), losses(tmp_path / "tp", "parallel=tp", "trainer.devices=2")
    gap = float(((tp - one).abs() / one).max())
    print(f"hf llama tp=2: losses {gap:.2e}")  # measured 2.3e-4 over 6 steps
    assert torch.isfinite(tp).all() and gap < 2e-3, gap

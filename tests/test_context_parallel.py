"""Context parallelism (``parallel.cp``): the split, attention over the whole sequence, runs equal to one process.

GPT's layouts with cp are in ``test_parity.py``'s families; here the pieces (balance, attention and its gradients
against whole-sequence attention on gloo ranks), Llama through the runner (grouped-query attention and rotary
positions under the split), refusals, and a checkpoint moving between cp degrees (``test_resume_layouts.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from disttrain.config.typed import model_typed
from disttrain.config.validation import validate
from disttrain.data.spec import DataSpec, example_batch
from disttrain.errors import ConfigError
from disttrain.models import MODELS, build_model
from disttrain.models.attention import causal_attention
from disttrain.parallel import causal_blocks
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.context import SequenceSplit, apply_context_parallel
from disttrain.plan.measure import measured_activations
from disttrain.plan.planner import predicted_activation_bytes
from tests.dist_utils import run_on_ranks
from tests.test_parity import CLIP, LOSS_RTOL, STEPS, WEIGHT_ATOL, check_against, run_summary

T = 32


def test_each_rank_holds_an_early_and_a_late_chunk_and_together_every_token() -> None:
    splits = [SequenceSplit(None, rank, 4) for rank in range(4)]
    positions = [split.positions(T // 4).tolist() for split in splits]
    assert positions[0] == [0, 1, 2, 3, 28, 29, 30, 31]
    assert positions[3] == [12, 13, 14, 15, 16, 17, 18, 19]
    assert sorted(p for rank in positions for p in rank) == list(range(T))
    tokens = torch.arange(2 * T).view(2, T)
    assert splits[1].split(tokens).tolist() == [positions[1], [T + p for p in positions[1]]]


def test_tokens_and_attention_work_per_rank_balance_at_cp4() -> None:
    # attention work = the (query, key) pairs a rank's causal masks let through
    work = [sum(int(mask.sum()) for _, _, mask in SequenceSplit(None, rank, 4).chunk_masks(T // 4, "cpu"))
            for rank in range(4)]
    assert sum(work) == T * (T + 1) // 2  # every pair of the causal sequence, once
    assert max(work) / min(work) <= 1.05, work
    contiguous = [sum(range(r * T // 4 + 1, (r + 1) * T // 4 + 1)) for r in range(4)]  # what slices would give
    assert max(contiguous) / min(contiguous) > 2


def _split_attention_matches_whole(kv_heads: int, dtype: torch.dtype, masked: bool) -> dict:
    if masked:  # the form that runs with dropout or off the CPU: one masked call per chunk
        causal_blocks.supported = lambda q, k, v, dropout_p: None
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same whole-sequence tensors on every rank
    q = torch.randn(2, 4, T, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, kv_heads, T, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, kv_heads, T, 8, dtype=dtype, requires_grad=True)
    weight = torch.randn(2, 4, T, 8, dtype=dtype)
    (causal_attention(q, k, v) * weight).sum().backward()
    whole = [q.grad.clone(), k.grad.clone(), v.grad.clone()]
    split = SequenceSplit(dist.group.WORLD, rank, size)
    parts = [split.split(x.detach(), dim=2).requires_grad_() for x in (q, k, v)]
    out = causal_attention(*parts, split=split)
    reference = split.split(causal_attention(q, k, v).detach(), dim=2)
    (out * split.split(weight, dim=2)).sum().backward()
    return {"out": (out.detach() - reference).abs().max().item(),
            "grads": [(part.grad - split.split(g, dim=2)).abs().max().item()
                      for part, g in zip(parts, whole, strict=True)]}


@pytest.mark.parametrize("masked", [False, True], ids=["blocks", "masked"])
@pytest.mark.parametrize(("ranks", "kv_heads"), [(2, 4), (4, 2)])
def test_split_attention_and_its_gradients_equal_whole_sequence_attention(ranks, kv_heads, masked) -> None:
    for result in run_on_ranks(_split_attention_matches_whole, ranks, kv_heads, torch.float64, masked):
        assert result["out"] < 1e-12 and max(result["grads"]) < 1e-12, result


LLAMA = ["model=llama", "model.flavour=micro", "data=pydocs", "data.block_size=32", "batch.global_size=8",
         f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=2",
         "trainer.limit_test_batches=2", "trainer.run_test=false", "scheduler.warmup_fraction=0.1", "logger=csv",
         "callbacks=none", f"trainer.val_check_interval={STEPS}", "trainer.check_val_every_n_epoch=null", "optim=sgd",
         "optim.momentum=0", "optim.nesterov=false", "optim.lr=0.5", f"trainer.gradient_clip_val={CLIP}"]


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory) -> dict:
    return run_summary(tmp_path_factory.mktemp("llama-single"), LLAMA)


@pytest.mark.parametrize("layout", [["parallel.cp=2", "trainer.devices=2"], ["parallel.cp=4", "trainer.devices=4"],
                                    ["parallel=tp", "parallel.cp=2", "parallel.zero_stage=3", "trainer.devices=4"]],
                         ids=["cp2", "cp4", "cp2xtp2"])
def test_llama_under_cp_matches_one_process(tmp_path, llama_reference, layout) -> None:
    # grouped-query attention (4 query heads on 2 key/value heads) and rotary positions at split positions
    check_against(llama_reference, run_summary(tmp_path / "run", [*LLAMA, *layout]), clipped=True,
                  loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL)


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["parallel.cp=2", "trainer.devices=2"], "parallel.cp", "splits text sequences"),  # the digits CNN
        (["model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=30", "parallel.cp=2",
          "trainer.devices=2"], "parallel.cp", "divides the sequence length 30"),
        (["model=gpt", "model.flavour=micro", "data=pydocs", "parallel=zero1", "parallel.cp=2",
          "trainer.devices=4"], "parallel.zero_stage", "0, 2 or 3 with parallel.cp > 1"),
        (["model=gpt", "model.flavour=micro", "data=pydocs", "parallel=tp", "parallel.cp=2", "trainer.devices=4"],
         "parallel.zero_stage", "2 or 3 with tp > 1 and cp > 1"),
        (["model=gpt", "model.flavour=micro", "data=pydocs", "parallel=pipeline", "parallel.pp=2", "parallel.cp=2",
          "trainer.devices=4"], "parallel.zero_stage", "2 or 3 with parallel.cp > 1 and pp > 1"),
        (["model=gpt", "model.flavour=micro", "data=pydocs", "parallel.cp=3", "trainer.devices=2"], "parallel",
         "multiply to 3"),
    ],
)
def test_cp_refusals_are_one_line(make_config, overrides, key, allowed) -> None:
    with pytest.raises(ConfigError) as info:
        validate(make_config(overrides))
    message = str(info.value)
    assert "\n" not in message and info.value.key.startswith(key), message
    assert allowed in message, message


def _measured_on_cp_ranks(policies: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """This rank's measured activations (held after forward, peak in backward) of the nano GPT on 4 sequences of
    256 tokens split over the ranks, under each checkpointing policy."""
    torch.set_num_threads(1)
    split = SequenceSplit(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    inputs, targets = (split.split(t) for t in example_batch(PLANNED, 4))
    measured = {}
    for policy in policies:
        net = _nano_gpt()
        if policy != "none":
            apply_activation_checkpointing(net, policy=policy)
        apply_context_parallel(net, split)
        # the smaller of two measurements: gloo releases a collective's buffers on its own thread, and on a busy
        # machine one may still be alive when forward ends (measured 1.54 MB held where 0.89 MB is, once)
        first, second = (measured_activations(net, (inputs, targets)) for _ in range(2))
        measured[policy] = (min(first[0], second[0]), min(first[1], second[1]))
    return measured


PLANNED = DataSpec("text", vocab_size=96, block_size=256)


def _nano_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_typed(OmegaConf.create({"name": "gpt", "flavour": "nano"}), MODELS), PLANNED)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_planner_predicts_what_a_cp_rank_measures_within_15_percent(cp) -> None:
    """Held after forward and peak in backward per rank, predicted / measured on the most loaded rank (nano GPT,
    4 x 256 tokens), as ``benchmarks/long_context.py`` prints at longer lengths. Measured: held 1.000-1.002 for
    every policy at cp 2 and 4; peak 1.03-1.08 (none), 1.05-1.08 (selective), 1.08-1.14 (full)."""
    policies = ("none", "selective", "full")
    ranks = run_on_ranks(_measured_on_cp_ranks, cp, policies)
    # the plan is of the most loaded rank: ranks attend over different key lengths per chunk, and gloo frees
    # collective buffers on its own thread a little later or sooner
    measured = {policy: tuple(max(rank[policy][i] for rank in ranks) for i in (0, 1)) for policy in policies}
    for policy in policies:
        predicted = predicted_activation_bytes(_nano_gpt(), PLANNED, 4, cp, policy)
        held, peak = measured[policy]
        assert predicted.held == pytest.approx(held, rel=0.15), (policy, predicted, held)
        assert predicted.peak == pytest.approx(peak, rel=0.15), (policy, predicted, peak)
    assert measured["full"][1] < measured["selective"][1] < measured["none"][1]

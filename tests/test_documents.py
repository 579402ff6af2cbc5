"""Packed windows with document masks: each document of a window attends only within itself, with positions
restarting at it, so its logits equal the logits of the document fed alone (gpt, llama, moe, an HF Llama), whole
and under context parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disttrain.data.spec import DataSpec
from disttrain.models import MODELS, build_model
from disttrain.models.documents import document_ids, document_positions
from disttrain.parallel.context import SequenceSplit, apply_context_parallel
from tests.dist_utils import run_on_ranks

END = 1
"""The end-of-document token of the test windows."""
VOCAB, WINDOW = 64, 32
EXACT = 1e-6
# measured (fp32): each document's logits within 1.8e-7 of its logits alone (gpt, llama, moe, HF Llama and Qwen3,
# whole and on 2 and 4 cp ranks), cp gradients within 2.8e-9 of one process; the same weights reading the window as
# one sequence differ by 0.13 to 0.44


def test_document_ids_and_positions_restart_after_each_end_token() -> None:
    tokens = torch.tensor([[5, 6, END, 7, END, END, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12]])
    ids = document_ids(tokens, END)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0] * 8]
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


def packed_windows(seed: int = 0) -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """Two windows of documents (each closed by ``END`` but a window's last, which runs on), and for each window the
    ``(start, end)`` of its documents."""
    generator = torch.Generator().manual_seed(seed)
    windows, spans = [], []
    for lengths in ([7, 12, 1, 12], [WINDOW - 3, 3]):
        tokens, starts = [], []
        for length in lengths:
            starts.append(len(tokens))
            body = torch.randint(2, VOCAB, (length,), generator=generator).tolist()
            tokens += body[:-1] + [END]
        tokens[-1] = 2  # the window's last document is cut, not closed
        windows.append(tokens)
        spans.append([(s, e) for s, e in zip(starts, [*starts[1:], WINDOW], strict=True)])
    return torch.tensor(windows), spans


def build(name: str, document_end: int | None, **sizes) -> torch.nn.Module:
    """A micro model ``name`` for ``WINDOW``-token windows (documents closed by ``document_end``)."""
    cfg = MODELS.get(name).schema(name=name, flavour="micro", **sizes)
    spec = DataSpec(kind="text", vocab_size=VOCAB, block_size=WINDOW, document_end=document_end)
    torch.manual_seed(0)
    return build_model(cfg, spec).eval()


def largest_difference_from_documents_alone(model: torch.nn.Module, logits: torch.Tensor,
                                            windows: torch.Tensor, spans) -> float:
    """The largest difference between each document's logits in ``logits`` (of ``windows``) and its logits fed
    to ``model`` alone."""
    worst = 0.0
    with torch.no_grad():
        for row, documents in enumerate(spans):
            for start, end in documents:
                alone = model(windows[row:row + 1, start:end])
                worst = max(worst, (logits[row:row + 1, start:end] - alone).abs().max().item())
    return worst


MODEL_SIZES = {"gpt": {}, "llama": {}, "moe": {"n_experts": 4, "top_k": 2}}


@pytest.mark.parametrize("name", list(MODEL_SIZES))
def test_each_document_of_a_packed_window_has_its_logits_alone(name) -> None:
    model = build(name, END, **MODEL_SIZES[name])
    windows, spans = packed_windows()
    with torch.no_grad():
        logits = model(windows)
    difference = largest_difference_from_documents_alone(model, logits, windows, spans)
    assert difference < EXACT, difference
    # the same weights reading the window as one sequence: later documents see the earlier ones
    whole = build(name, None, **MODEL_SIZES[name])
    with torch.no_grad():
        assert largest_difference_from_documents_alone(whole, whole(windows), windows, spans) > 1e-3


def _documents_under_cp(name: str) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = build(name, END, **MODEL_SIZES[name])
    windows, spans = packed_windows()
    split = SequenceSplit(dist.group.WORLD, rank, size)
    reference = build(name, END, **MODEL_SIZES[name])
    apply_context_parallel(model, split)
    local = model(split.split(windows))
    whole = torch.zeros(windows.size(0), WINDOW, local.size(-1))
    whole[:, split.positions(WINDOW // size)] = local.detach()
    loss_grads = {}
    local.float().pow(2).mean().backward()
    for param_name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad.clone()
            dist.all_reduce(grad)
            loss_grads[param_name] = grad
    # one process over the whole windows: the same loss (a mean over every token) and its gradients
    reference.train()
    reference(windows).float().pow(2).mean().backward()
    grad_difference = max((loss_grads[n] / size - p.grad).abs().max().item()
                          for n, p in reference.named_parameters() if p.grad is not None)
    gathered = [torch.empty_like(whole) for _ in range(size)]
    dist.all_gather(gathered, whole)
    logits = sum(gathered)  # each position is filled by the one rank holding it, zero elsewhere
    reference.eval()
    return {"documents": largest_difference_from_documents_alone(reference, logits, windows, spans),
            "grads": grad_difference}


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_documents_under_context_parallelism_have_their_logits_alone(name, ranks) -> None:
    for result in run_on_ranks(_documents_under_cp, ranks, name):
        assert result["documents"] < EXACT and result["grads"] < EXACT, result


HF_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 64}
HF_ARCHS = {"llama": HF_SIZES, "qwen3": {**HF_SIZES, "head_dim": 16}}


def build_hf_model(arch: str, document_end: int | None, attention: str | None = None) -> torch.nn.Module:
    """A tiny ``transformers`` ``arch`` model under disttrain's network (never downloaded)."""
    from disttrain.models.hf.config import HFConfig
    from disttrain.models.hf.model import build_hf

    torch.manual_seed(0)
    spec = DataSpec(kind="text", vocab_size=VOCAB, block_size=WINDOW, document_end=document_end)
    return build_hf(HFConfig(arch=arch, fields=HF_ARCHS[arch], attn_implementation=attention), spec).eval()


@pytest.mark.parametrize(("arch", "attention"), [("llama", None), ("llama", "eager"), ("qwen3", None)])
def test_each_document_of_a_packed_window_has_its_logits_alone_in_an_hf_model(arch, attention) -> None:
    model = build_hf_model(arch, END, attention)
    windows, spans = packed_windows()
    with torch.no_grad():
        logits = model(windows)
    assert largest_difference_from_documents_alone(model, logits, windows, spans) < EXACT
    whole = build_hf_model(arch, None, attention)
    with torch.no_grad():
        assert largest_difference_from_documents_alone(whole, whole(windows), windows, spans) > 1e-3


def test_an_hf_model_type_not_checked_for_packed_documents_is_refused_in_one_line() -> None:
    from disttrain.errors import ConfigError
    from disttrain.models.hf.config import HFConfig
    from disttrain.models.hf.model import build_hf

    spec = DataSpec(kind="text", vocab_size=VOCAB, block_size=WINDOW, document_end=END)
    gpt2 = {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64}
    with pytest.raises(ConfigError, match=r"data\.document_mask.*model type gpt2.*llama, qwen3") as error:
        build_hf(HFConfig(arch="gpt2", fields=gpt2), spec)
    assert "\n" not in str(error.value)


def _hf_documents_under_cp(arch: str) -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    model = build_hf_model(arch, END)
    windows, spans = packed_windows()
    split = SequenceSplit(dist.group.WORLD, rank, size)
    apply_context_parallel(model, split)
    with torch.no_grad():
        local = model(split.split(windows))
    whole = torch.zeros(windows.size(0), WINDOW, local.size(-1))
    whole[:, split.positions(WINDOW // size)] = local
    gathered = [torch.empty_like(whole) for _ in range(size)]
    dist.all_gather(gathered, whole)
    reference = build_hf_model(arch, END)
    return {"documents": largest_difference_from_documents_alone(reference, sum(gathered), windows, spans)}


@pytest.mark.parametrize("ranks", [2, 4])
def test_documents_of_an_hf_llama_under_context_parallelism_have_their_logits_alone(ranks) -> None:
    for result in run_on_ranks(_hf_documents_under_cp, ranks, "llama"):
        assert result["documents"] < EXACT, result


def test_a_model_of_your_own_is_refused_packed_documents_in_one_line() -> None:
    from disttrain.errors import ConfigError
    from disttrain.models.target import TargetModelConfig

    spec = DataSpec(kind="text", vocab_size=VOCAB, block_size=WINDOW, document_end=END)
    with pytest.raises(ConfigError, match=r"data\.document_mask.*model\._target_=torch\.nn\.Identity") as error:
        build_model(TargetModelConfig("torch.nn.Identity"), spec)
    assert "\n" not in str(error.value)


PIPELINE_BATCH, MICROBATCHES = 8, 4


def packed_batch(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of ``PIPELINE_BATCH`` windows, each with end tokens at random places."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, VOCAB, (PIPELINE_BATCH, WINDOW + 1), generator=generator)
    ends = torch.rand(tokens.shape, generator=generator) < 0.15
    tokens[ends] = END
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _pipelined_documents(name: str, schedule: str, stages_per_rank: int, checkpoint: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.parallel.config import ParallelConfig, PipelineOptions
    from disttrain.parallel.layout import Layout
    from disttrain.parallel.pipeline.runtime import build_pipeline, scaled_cross_entropy

    parallel = ParallelConfig(pp=2, activation_checkpoint=checkpoint, pipeline=PipelineOptions(
        schedule=schedule, microbatches=MICROBATCHES, stages_per_rank=stages_per_rank))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    model = pipelined_model(name)
    inputs, targets = packed_batch()
    example = inputs[:PIPELINE_BATCH // MICROBATCHES]
    owned, pipeline = build_pipeline(model, mesh, Layout.on(parallel, 2), parallel, torch.device("cpu"),
                                     lambda out, target: scaled_cross_entropy(out, target, MICROBATCHES), example)
    result = pipeline.run(inputs, targets, train=True)
    loss = torch.zeros(()) if result is None else result[0].detach()
    dist.all_reduce(loss)  # only the rank with the last stage holds it
    # numpy arrays: torch tensors would travel through shared memory that dies with the rank
    return {"loss": loss.item(), "grads": {n: p.grad.numpy().copy() for n, p in owned.named_parameters()}}


PIPELINE_SIZES = {"gpt": {"tie_weights": False}, "llama": {}}


def pipelined_model(name: str) -> torch.nn.Module:
    """A model ``name`` whose pipeline units share no parameter, in training mode (``hf``: an HF Llama)."""
    model = build_hf_model("llama", END) if name == "hf" else build(name, END, **PIPELINE_SIZES[name])
    return model.train()


@pytest.mark.parametrize(("name", "schedule", "stages_per_rank", "checkpoint"), [
    ("gpt", "1f1b", 1, "full"), ("llama", "zero_bubble", 2, "full"), ("llama", "gpipe", 1, "none"),
    ("hf", "1f1b", 1, "full")])
def test_pipeline_stages_with_documents_match_one_process(name, schedule, stages_per_rank, checkpoint) -> None:
    from disttrain.loss import token_cross_entropy

    results = run_on_ranks(_pipelined_documents, 2, name, schedule, stages_per_rank, checkpoint)
    model = pipelined_model(name)
    inputs, targets = packed_batch()
    loss = token_cross_entropy(model(inputs), targets, "mean")
    loss.backward()
    # measured (fp32, gloo): the same loss, gradients within 3.0e-8; a stage recomputing a checkpointed block
    # within another micro-batch's documents moved them by 1.1e-2
    assert abs(results[0]["loss"] - loss.item()) < EXACT and results[0]["loss"] == results[1]["loss"]
    grads = {key: torch.from_numpy(value) for result in results for key, value in result["grads"].items()}
    assert set(grads) == {n for n, p in model.named_parameters()}
    difference = max((grads[n] - p.grad).abs().max().item() for n, p in model.named_parameters())
    assert difference < EXACT, difference


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_the_planner_counts_the_document_mask_whatever_the_checkpointing(policy) -> None:
    from omegaconf import OmegaConf

    from disttrain.config.typed import model_typed
    from disttrain.data.spec import example_batch
    from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from disttrain.plan.measure import measured_activations
    from disttrain.plan.planner import predicted_activation_bytes

    spec = DataSpec("text", vocab_size=96, block_size=256, document_end=END)

    def nano_gpt() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(model_typed(OmegaConf.create({"name": "gpt", "flavour": "nano"}), MODELS), spec)

    net = nano_gpt()
    if policy != "none":
        apply_activation_checkpointing(net, policy=policy)
    # the smaller of two: a busy machine may free a buffer a little late
    held = min(measured_activations(net, example_batch(spec, 4))[0] for _ in range(2))
    predicted = predicted_activation_bytes(nano_gpt(), spec, 4, 1, policy)
    # measured: 0.998-1.000 for every policy; without the mask's term, 0.77 under full checkpointing (the 1 MB mask
    # of 4 x 256 x 256 fp32 scores beside 3.5 MB of block inputs)
    assert predicted.held == pytest.approx(held, rel=0.02), (predicted, held)


def test_the_planners_table_by_length_grows_the_document_mask_with_the_square_of_the_length() -> None:
    from disttrain.plan.layout import Layout
    from disttrain.plan.memory import activations_by_length
    from disttrain.plan.model_stats import measure_model

    tables = {}
    for end in (END, None):
        spec = DataSpec("text", vocab_size=VOCAB, block_size=64, document_end=end)
        stats = measure_model(build("gpt", end, block_size=256), spec, 4, shard_units=["blocks.0", "blocks.1"])
        tables[end] = activations_by_length(stats, None, Layout(micro_size=4), 1.0)
    extra = {length: tables[END][length][1] - tables[None][length][1] for length in (64, 128, 256)}
    # the mask, 4 x T x T fp32 scores, beside the document ids' few bytes per token
    assert extra[128] == pytest.approx(4 * extra[64], rel=0.02)
    assert extra[256] == pytest.approx(16 * extra[64], rel=0.02)

"""The Llama model: shapes, causality, grouped-query attention, rotary positions, its parallel plan, config
errors, the meta device and the parameter count."""

from __future__ import annotations

import dataclasses
from fnmatch import fnmatchcase

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from disttrain.errors import ConfigError
from disttrain.models import MODELS, DataSpec, build_model
from disttrain.models.llama import (
    FLAVOURS,
    Llama,
    LlamaConfig,
    LlamaDims,
    TransformerBlock,
    apply_rotary,
    default_mlp_hidden,
    resolve_llama_dims,
)
from disttrain.models.protocol import TP_STYLES, expand_units

TEXT = DataSpec(kind="text", vocab_size=65, block_size=16)
DIGITS = DataSpec(kind="image", num_classes=10, in_channels=1, image_size=8)


def micro(**overrides: object) -> LlamaConfig:
    return LlamaConfig(**{"flavour": "micro", **overrides})


def build_micro(**overrides: object) -> Llama:
    torch.manual_seed(0)
    return build_model(micro(**overrides), TEXT)


def test_registered_with_documented_schema() -> None:
    assert MODELS.get("llama").schema is LlamaConfig
    node = OmegaConf.structured(LlamaConfig)
    assert list(node)[0] == "name" and node.name == "llama"
    typed = OmegaConf.to_object(OmegaConf.merge(node, {"n_kv_head": 1, "dropout": 0.1}))
    assert isinstance(typed, LlamaConfig) and typed.n_kv_head == 1 and typed.dropout == 0.1


def test_group_file_composes_and_builds(make_config) -> None:
    from disttrain.config import validate

    run = validate(make_config(["model=llama", "data=pydocs"]), world_size=None)
    assert isinstance(run.model, LlamaConfig) and run.model.flavour == "nano"
    with torch.device("meta"):
        model = build_model(run.model, DataSpec(kind="text", vocab_size=256, block_size=64))
    assert isinstance(model, Llama) and model.dims.n_kv_head == 2


def test_forward_shape_and_names() -> None:
    model = build_micro()
    idx = torch.randint(0, 65, (2, 16))
    assert model(idx).shape == (2, 16, 65)
    assert model(idx[:, :5]).shape == (2, 5, 65)
    assert isinstance(model.embed.tok, torch.nn.Embedding)
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2
    assert all(isinstance(layer, TransformerBlock) for layer in model.layers)
    layer = model.layers[0]
    assert isinstance(layer.attention_norm, torch.nn.RMSNorm) and isinstance(model.norm, torch.nn.RMSNorm)
    hd = model.dims.head_dim
    assert (layer.attention.q.out_features, layer.attention.k.out_features) == (4 * hd, 2 * hd)
    assert layer.feed_forward.w1.out_features == default_mlp_hidden(32, 32) == 96
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.output.weight is not model.embed.tok.weight
    assert not list(model.buffers())
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_is_causal() -> None:
    model = build_micro().eval()
    idx = torch.randint(0, 65, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 65
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_backward_reaches_all_params() -> None:
    model = build_micro(dropout=0.1)
    idx = torch.randint(0, 65, (2, 16))
    F.cross_entropy(model(idx).reshape(-1, 65), idx.reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_grouped_query_equals_repeated_multi_head() -> None:
    gqa = build_micro().eval()
    dims = gqa.dims
    group, hd = dims.n_head // dims.n_kv_head, dims.head_dim
    mha = Llama(dataclasses.replace(dims, n_kv_head=dims.n_head)).eval()
    state = gqa.state_dict()
    for name, w in state.items():
        if name.endswith(("attention.k.weight", "attention.v.weight")):
            # each kv head's rows, repeated for the `group` consecutive query heads that read it
            state[name] = w.view(dims.n_kv_head, hd, -1).repeat_interleave(group, dim=0).reshape(-1, w.size(-1))
    mha.load_state_dict(state)
    idx = torch.randint(0, 65, (2, 16))
    torch.testing.assert_close(mha(idx), gqa(idx))


def test_attention_matches_explicit_reference() -> None:
    model = build_micro().eval()
    attn, dims = model.layers[0].attention, model.dims
    x = torch.randn(2, 16, dims.n_embd)
    b, t, hd = 2, 16, dims.head_dim
    q = apply_rotary(attn.q(x).view(b, t, dims.n_head, hd).transpose(1, 2))
    k = apply_rotary(attn.k(x).view(b, t, dims.n_kv_head, hd).transpose(1, 2))
    v = attn.v(x).view(b, t, dims.n_kv_head, hd).transpose(1, 2)
    kv_of_head = torch.arange(dims.n_head) // (dims.n_head // dims.n_kv_head)
    scores = q @ k[:, kv_of_head].transpose(-1, -2) / hd**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    y = (scores.softmax(-1) @ v[:, kv_of_head]).transpose(1, 2).reshape(b, t, -1)
    torch.testing.assert_close(attn(x), attn.o(y))


def test_rotary_scores_depend_only_on_relative_position() -> None:
    model = build_micro()
    attn, dims = model.layers[0].attention, model.dims
    t, hd = 16, dims.head_dim
    # the same token at every position: without rotary every query-key score would be equal
    x = torch.randn(dims.n_embd).expand(1, t, -1)
    with torch.no_grad():
        q = apply_rotary(attn.q(x).view(1, t, dims.n_head, hd).transpose(1, 2))
        k = apply_rotary(attn.k(x).view(1, t, dims.n_kv_head, hd).transpose(1, 2))
    scores = q @ k.repeat_interleave(dims.n_head // dims.n_kv_head, dim=1).transpose(-1, -2)  # [1, H, T, T]
    for shift in (1, 3, 7):
        torch.testing.assert_close(scores[..., shift:, shift:], scores[..., :-shift, :-shift])
    assert not torch.allclose(scores[..., 5, 5], scores[..., 5, 0])
    # rotation keeps lengths, and position 0 is not rotated
    v = torch.randn(1, 2, t, hd)
    torch.testing.assert_close(apply_rotary(v).norm(dim=-1), v.norm(dim=-1))
    torch.testing.assert_close(apply_rotary(v)[..., 0, :], v[..., 0, :])


def test_pipeline_units_compose_to_forward() -> None:
    model = build_micro().eval()
    units = expand_units(model, model.pipeline_units())
    assert units == ["embed", "layers.0", "layers.1", "norm", "output"]
    idx = torch.randint(0, 65, (2, 16))
    out = idx
    for name in units:
        out = model.get_submodule(name)(out)
    torch.testing.assert_close(out, model(idx))
    assert [id(m) for m in (model.get_submodule(n) for n in expand_units(model, model.shard_units()))] == [
        id(layer) for layer in model.layers]


def test_tp_plan_matches_modules_and_sizes() -> None:
    model = build_micro()
    names = [name for name, _ in model.named_modules() if name]

    def matches(pattern: str) -> list[str]:
        parts = pattern.split(".")
        return [n for n in names if len(n.split(".")) == len(parts)
                and all(fnmatchcase(a, p) for a, p in zip(n.split("."), parts, strict=True))]

    plan = model.tp_plan()
    for pattern, style in plan.items():
        assert style in TP_STYLES, pattern
        assert matches(pattern), pattern
    for pattern, style in plan.items():
        if style in ("colwise", "rowwise"):
            assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in matches(pattern))
    assert list(plan.values()).count("sequence_split") == 1 and plan["embed"] == "sequence_split"
    assert model.tp_sizes() == {"model.n_head": 4, "model.n_kv_head": 2}


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"n_kv_head": 3}, "model.n_kv_head"), ({"n_embd": 36}, "model.n_head"),
     ({"n_embd": 30}, "model.n_head"), ({"flavour": "huge"}, "model.flavour"),
     ({"dropout": 1.0}, "model.dropout"), ({"n_layer": 0}, "model.n_layer"),
     ({"block_size": 8}, "model.block_size"), ({"vocab_size": 10}, "model.vocab_size"),
     ({"multiple_of": 0}, "model.multiple_of"), ({"mlp_hidden": -1}, "model.mlp_hidden"),
     ({"rope_theta": 0.0}, "model.rope_theta"), ({"norm_eps": 0.0}, "model.norm_eps")],
)
def test_bad_config(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_model(micro(**overrides), TEXT)
    assert err.value.key == key and "\n" not in str(err.value)


def test_odd_head_dim_and_image_data_are_rejected() -> None:
    with pytest.raises(ConfigError, match="even head width"):
        micro(n_embd=36).validate(TEXT)  # 36 / 4 heads = 9
    with pytest.raises(ConfigError, match="text data") as err:
        build_model(micro(), DIGITS)
    assert err.value.key == "model.name"
    with pytest.raises(ConfigError, match="model.vocab_size"):
        resolve_llama_dims(LlamaConfig(flavour="small"), DataSpec(kind="text"))


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_flavours_resolve(flavour: str) -> None:
    preset = FLAVOURS[flavour]
    dims = resolve_llama_dims(LlamaConfig(flavour=flavour), DataSpec(kind="text", vocab_size=256))
    assert dataclasses.asdict(dims) == {**preset, "vocab_size": 256,
                                        "mlp_hidden": default_mlp_hidden(preset["n_embd"], 32)}
    assert dims.n_head % dims.n_kv_head == 0 and dims.head_dim % 2 == 0


def test_dims_precedence() -> None:
    dims = resolve_llama_dims(micro(n_layer=3, block_size=40, mlp_hidden=50), TEXT)
    assert (dims.n_layer, dims.block_size, dims.vocab_size, dims.mlp_hidden) == (3, 40, 65, 50)
    assert resolve_llama_dims(micro(multiple_of=64), TEXT).mlp_hidden == 128  # 85.3 rounded up to 64s
    assert isinstance(resolve_llama_dims(micro(), TEXT), LlamaDims)


def test_same_seed_same_init() -> None:
    a, b = build_micro(), build_micro()
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    residual = a.layers[0].attention.o.weight.std() / a.layers[0].attention.q.weight.std()
    assert 0.3 < residual < 0.7  # 1 / sqrt(2 * 2 layers) = 0.5


def test_small_flavour_on_meta_and_its_parameter_count() -> None:
    vocab = 32000
    with torch.device("meta"):
        model = build_model(LlamaConfig(flavour="small"), DataSpec(kind="text", vocab_size=vocab))
        logits = model(torch.zeros(1, 8, dtype=torch.long))
    assert logits.is_meta and logits.shape == (1, 8, vocab)
    assert all(p.is_meta for p in model.parameters())
    c, n_layer, kv_width, hidden = 768, 12, 4 * 64, 2048
    per_layer = 2 * c * c + 2 * c * kv_width + 3 * c * hidden + 2 * c  # q, o; k, v; w1, w2, w3; two norms
    expected = vocab * c + n_layer * per_layer + c + c * vocab  # embedding, layers, final norm, output
    count = model.num_params(non_embedding=False)
    print(f"llama small parameters: {count:,} (closed form {expected:,})")
    assert count == expected == 124_668_672
    assert model.num_params() == expected - vocab * c

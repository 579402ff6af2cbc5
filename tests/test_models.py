"""Model registry, the CNN and the GPT: shapes, gradients, causality, flavours, config errors, determinism."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from disttrain.errors import ConfigError
from disttrain.models import FLAVOURS, MODELS, CNNConfig, DataSpec, GPTConfig, build_model, resolve_gpt_dims
from disttrain.models.cnn import CNN, BasicBlock
from disttrain.models.gpt import GPT, Block
from disttrain.parallel.model_plan import pipeline_units_of

DIGITS = DataSpec(kind="image", num_classes=10, in_channels=1, image_size=8)
CIFAR = DataSpec(kind="image", num_classes=7, in_channels=3, image_size=32)
TEXT = DataSpec(kind="text", vocab_size=65, block_size=16)


def micro(**overrides: object) -> GPTConfig:
    return GPTConfig(flavour="micro", **overrides)


def test_registry_names_and_unknown_model() -> None:
    assert {"cnn", "gpt"} <= set(MODELS.names())
    assert MODELS.get("cnn").schema is CNNConfig and MODELS.get("gpt").schema is GPTConfig
    with pytest.raises(ConfigError) as err:
        MODELS.get("resnet9000")
    msg = str(err.value)
    assert "\n" not in msg and "model.name" in msg and "resnet9000" in msg and "cnn" in msg and "gpt" in msg


def test_schemas_are_omegaconf_structured_and_documented() -> None:
    for schema in (CNNConfig, GPTConfig):
        node = OmegaConf.structured(schema)
        assert list(node)[0] == "name"
        typed = OmegaConf.to_object(OmegaConf.merge(node, {"dropout": 0.1}))
        assert isinstance(typed, schema) and typed.dropout == 0.1
    assert OmegaConf.structured(CNNConfig).widths == [32, 64]


# ---------------------------------------------------------------- CNN


@pytest.mark.parametrize("spec", [DIGITS, CIFAR], ids=["digits", "cifar"])
def test_cnn_forward_shape(spec: DataSpec) -> None:
    torch.manual_seed(0)
    model = build_model(CNNConfig(), spec)
    x = torch.randn(4, spec.in_channels, spec.image_size, spec.image_size)
    assert model(x).shape == (4, spec.num_classes)


def test_cnn_blocks_and_pipeline_units() -> None:
    torch.manual_seed(0)
    model = build_model(CNNConfig(widths=[8, 16, 32], blocks_per_stage=2), DIGITS)
    assert isinstance(model, CNN) and isinstance(model.blocks, torch.nn.ModuleList)
    assert len(model.blocks) == 6 and all(isinstance(b, BasicBlock) for b in model.blocks)
    units = pipeline_units_of(model)
    assert units == ["stem", *(f"blocks.{i}" for i in range(6)), "head"]
    model.eval()
    x = torch.randn(3, 1, 8, 8)
    out = x
    for name in units:
        out = model.get_submodule(name)(out)
    torch.testing.assert_close(out, model(x))


def test_cnn_backward_reaches_all_params() -> None:
    torch.manual_seed(0)
    model = build_model(CNNConfig(dropout=0.1), CIFAR)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 7, (4,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"widths": []}, "model.widths"), ({"widths": [8, 0]}, "model.widths"),
     ({"blocks_per_stage": 0}, "model.blocks_per_stage"), ({"dropout": -0.1}, "model.dropout"),
     ({"dropout": 1.0}, "model.dropout")],
)
def test_cnn_bad_config(overrides: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_model(CNNConfig(**overrides), DIGITS)
    assert err.value.key == key and "\n" not in str(err.value)


def test_model_kind_must_match_data() -> None:
    with pytest.raises(ConfigError, match="model.name"):
        CNNConfig().validate(TEXT)
    with pytest.raises(ConfigError, match="model.name"):
        GPTConfig().validate(DIGITS)


# ---------------------------------------------------------------- GPT


def test_gpt_forward_shape_and_names() -> None:
    torch.manual_seed(0)
    model = build_model(micro(), TEXT)
    assert isinstance(model, GPT)
    idx = torch.randint(0, 65, (2, 16))
    assert model(idx).shape == (2, 16, 65)
    assert model(idx[:, :5]).shape == (2, 5, 65)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert all(isinstance(b, Block) for b in model.blocks)
    names = {n for n, _ in model.named_modules()}
    for sub in ("embed.wte", "embed.wpe", "ln_f", "lm_head", "blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v",
                "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"):
        assert sub in names, sub
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = build_model(micro(), TEXT).eval()
    idx = torch.randint(0, 65, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 65
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gpt_weight_tying() -> None:
    torch.manual_seed(0)
    tied = build_model(micro(), TEXT)
    assert tied.tied and tied.lm_head.weight is tied.embed.wte.weight
    untied = build_model(micro(tie_weights=False), TEXT)
    assert not untied.tied
    emb = 65 * 32
    assert untied.num_params(non_embedding=False) == tied.num_params(non_embedding=False) + emb
    assert tied.num_params() == tied.num_params(non_embedding=False) - 16 * 32
    assert untied.num_params() == tied.num_params()


def test_gpt_backward_reaches_all_params() -> None:
    torch.manual_seed(0)
    model = build_model(micro(dropout=0.1), TEXT)
    idx = torch.randint(0, 65, (2, 16))
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 65), idx.reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("flavour", sorted(FLAVOURS))
def test_gpt_flavours_resolve(flavour: str) -> None:
    preset = FLAVOURS[flavour]
    dims = resolve_gpt_dims(GPTConfig(flavour=flavour), DataSpec(kind="text", vocab_size=256))
    assert (dims.n_layer, dims.n_head, dims.n_embd) == (preset["n_layer"], preset["n_head"], preset["n_embd"])
    assert dims.block_size == preset["block_size"] and dims.vocab_size == 256
    assert dims.n_embd % dims.n_head == 0


def test_gpt2_flavour_has_124m_params_on_meta() -> None:
    with torch.device("meta"):
        model = build_model(GPTConfig(flavour="gpt2"), DataSpec(kind="text"))
    assert model.embed.wte.weight.is_meta
    assert (model.dims.vocab_size, model.dims.block_size) == (50304, 1024)
    assert abs(model.num_params(non_embedding=False) - 124.48e6) < 0.05e6
    assert abs(model.num_params() - 123.69e6) < 0.05e6


def test_gpt_dims_precedence() -> None:
    # Explicit sizes beat the data, the data beats the flavour.
    dims = resolve_gpt_dims(micro(n_layer=3, block_size=40), TEXT)
    assert (dims.n_layer, dims.block_size, dims.vocab_size) == (3, 40, 65)
    dims = resolve_gpt_dims(micro(vocab_size=128), DataSpec(kind="text", vocab_size=100))
    assert (dims.block_size, dims.vocab_size) == (32, 128)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [({"n_embd": 30, "n_head": 4}, "model.n_head"), ({"flavour": "huge"}, "model.flavour"),
     ({"dropout": -0.1}, "model.dropout"), ({"n_layer": 0}, "model.n_layer"),
     ({"n_embd": -8}, "model.n_embd"), ({"block_size": 8}, "model.block_size"),
     ({"vocab_size": 10}, "model.vocab_size")],
)
def test_gpt_bad_config(overrides: dict, key: str) -> None:
    cfg = GPTConfig(**{"flavour": "micro", **overrides})
    with pytest.raises(ConfigError) as err:
        build_model(cfg, TEXT)
    assert err.value.key == key and "\n" not in str(err.value)
    if key == "model.flavour":
        assert all(name in str(err.value) for name in FLAVOURS)


def test_gpt_needs_a_vocabulary() -> None:
    with pytest.raises(ConfigError, match="model.vocab_size"):
        resolve_gpt_dims(GPTConfig(flavour="nano"), DataSpec(kind="text"))


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize(("cfg", "spec"), [(CNNConfig(), DIGITS), (micro(), TEXT)], ids=["cnn", "gpt"])
def test_same_seed_same_init(cfg: object, spec: DataSpec) -> None:
    states = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        states.append(build_model(cfg, spec).state_dict())
    for key in states[0]:
        torch.testing.assert_close(states[0][key], states[1][key])
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0] if states[0][k].is_floating_point())

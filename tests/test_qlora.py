"""QLoRA (``model.lora.base_dtype=nf4``): the adapted base layers held as 4-bit NormalFloat codes through
bitsandbytes, frozen, a quarter of bf16's bytes; the adapters alone train; checkpoints hold the base dequantised
(bf16), never the codes; the settings refused before any rank starts.

The fast tests quantise a built GPT in this process (the planner's pricing of it: ``tests/test_plan_qlora.py``);
the slow ones train it through the runner (one process and
DDP on 2 ranks) beside a bf16-base LoRA run from the same start, and export it merged (the base dequantised).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from disttrain.models import build_model  # noqa: E402
from disttrain.models.lora import is_adapter, lora_layers  # noqa: E402
from disttrain.models.nf4 import (  # noqa: E402
    BLOCK_SIZE,
    NF4Format,
    NF4Linear,
    nf4_layers,
    quantise_adapted_bases,
)
from tests.test_parity import BASE, FAMILIES, run_summary  # noqa: E402

ADAPTERS = ["model.lora.rank=4", "model.lora.init=random"]
WIDE = [*BASE, "model.n_embd=64"]
"""The micro GPT with its projections' input widths multiples of nf4's block (64)."""
NF4 = [*ADAPTERS, "model.lora.base_dtype=nf4", "trainer.precision=bf16-mixed"]
DOUBLE = [*NF4, "model.lora.double_quant=true"]
BF16 = [*ADAPTERS, "model.lora.base_dtype=bfloat16", "trainer.precision=bf16-mixed"]
TARGETS = {"q", "k", "v", "proj", "fc"}
"""The micro GPT's projections its tensor-parallel plan splits: the default targets."""
FIRST_LOSS_ATOL = 2e-3
"""The nf4 base's loss on one batch less the bf16 base's, from the same weights: measured 1.9e-4 (micro GPT at
width 64, random adapters, one batch of random tokens; the weights' nf4 error is 9% of their norm); ten times it."""
MERGED_NF4_LOSS_ATOL = 1e-3
"""A run without adapters from a QLoRA run's merged export, its validation loss before its first step less the
QLoRA run's last (about 5.33): measured 1.2e-4 (AVX-512) and 1.7e-4 (AVX2), the merged projections rounded to bf16
against the base and the adapters' product computed apart in bf16."""
BYTES_SHARE = 0.3
"""nf4's bytes over bf16's for the base projections: half a byte per weight plus one fp32 absmax per
``BLOCK_SIZE`` weights, (0.5 + 4 / 64) / 2 = 0.28125."""


def double_quant_saving(layer: NF4Linear) -> int:
    """Bytes a double-quantised ``layer`` holds less than plain nf4 would, from the block sizes bitsandbytes
    reports: each block's absmax in one byte instead of four, plus one fp32 absmax per nested block and the
    fp32 offset."""
    state = layer.quant_state
    blocks = layer.weights // state.blocksize
    nested_blocks = -(-blocks // state.state2.blocksize)
    fp32, code = torch.float32.itemsize, torch.uint8.itemsize
    return blocks * (fp32 - code) - nested_blocks * fp32 - fp32


def built(make_config, overrides: list[str]) -> torch.nn.Module:
    """The model a run of ``overrides`` builds on this process (before any layout)."""
    run = validate(make_config(overrides))
    return build_model(run.model, run.datamodule.spec)


def by_hand(layer: NF4Linear) -> torch.Tensor:
    """The weight ``layer`` holds, dequantised from its codes here: each byte two indices into nf4's code book
    (high half first), each block of ``BLOCK_SIZE`` scaled by its absmax."""
    codes = layer.weight.flatten()
    indices = torch.stack([codes >> 4, codes & 15], dim=1).flatten().long()
    values = layer.quant_state.code[indices].float().view(-1, BLOCK_SIZE) * layer.quant_state.absmax[:, None]
    return values.view(layer.out_features, layer.in_features)


def loss_of(net: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``net`` on ``tokens`` under bf16 autocast (as ``bf16-mixed`` computes)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = net(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def test_nf4_bases_are_frozen_codes_at_a_quarter_of_bf16_and_the_adapters_alone_train(make_config):
    net = built(make_config, [*WIDE, *NF4])
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    adapted = len(lora_layers(net))
    assert quantise_adapted_bases(net) == adapted
    layers = nf4_layers(net)
    assert {name.split(".")[-2] for name, _ in layers} == TARGETS
    nf4_bytes = bf16_bytes = 0
    for name, layer in layers:
        assert layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad
        assert layer.weight.numel() * 2 == layer.out_features * layer.in_features  # two codes a byte
        nf4_bytes += layer.weight.nbytes + layer.quant_state.absmax.nbytes
        bf16_bytes += before[f"{name}.weight"].to(torch.bfloat16).nbytes
    assert nf4_bytes / bf16_bytes <= BYTES_SHARE, nf4_bytes / bf16_bytes
    x = torch.randn(3, layers[0][1].in_features, generator=torch.Generator().manual_seed(2))
    for name, layer in layers:  # the layer computes with the weight its codes hold, in bf16
        weight = by_hand(layer)
        assert (weight - before[f"{name}.weight"]).norm() <= 0.15 * before[f"{name}.weight"].norm(), name
        if layer.in_features == x.shape[1]:
            expected = F.linear(x.to(torch.bfloat16).float(), weight.to(torch.bfloat16).float())
            torch.testing.assert_close(layer(x).float(), expected, rtol=0.02, atol=0.02, msg=name)
    # embeddings, norms, head and the base's biases as built (fp32), not quantised
    for name, p in net.named_parameters():
        if p.dtype != torch.uint8:
            assert p.dtype == torch.float32 and torch.equal(p, before[name]), name
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    loss_of(net, tokens).backward()
    with_grads = {name for name, p in net.named_parameters() if p.grad is not None}
    assert with_grads and all(is_adapter(name) for name in with_grads)
    assert all(p.grad.abs().sum() > 0 for name, p in net.named_parameters() if name in with_grads)


def test_the_nf4_bases_first_loss_is_the_bf16_bases_within_the_quantisation_error(make_config):
    """From the same weights, one batch's loss with the base in nf4 and in bf16 (as ``base_dtype=bfloat16``)."""
    torch.manual_seed(0)
    net = built(make_config, [*WIDE, *NF4])
    bf16 = copy.deepcopy(net)
    for name, p in bf16.named_parameters():
        if not is_adapter(name):
            p.data = p.data.to(torch.bfloat16)
    quantise_adapted_bases(net)
    tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        gap = abs(loss_of(net, tokens).item() - loss_of(bf16, tokens).item())
    print(f"first loss gap nf4 - bf16 base: {gap:.3g}")
    assert 0 < gap <= FIRST_LOSS_ATOL, gap


def test_a_state_dict_holds_the_base_dequantised_and_loads_back_to_the_same_codes(make_config):
    net = built(make_config, [*WIDE, *NF4])
    quantise_adapted_bases(net)
    state = net.state_dict()
    name, layer = nf4_layers(net)[0]
    saved = state[f"{name}.weight"]
    assert saved.dtype == torch.bfloat16 and saved.shape == (layer.out_features, layer.in_features)
    assert not any(tensor.dtype == torch.uint8 for tensor in state.values())
    assert torch.equal(saved, layer.dequantised())
    other = built(make_config, [*WIDE, *NF4, "seed=7"])
    quantise_adapted_bases(other)
    other.load_state_dict(state, strict=True)
    for (_, mine), (_, theirs) in zip(nf4_layers(net), nf4_layers(other), strict=True):
        assert torch.equal(mine.weight, theirs.weight) and torch.equal(mine.dequantised(), theirs.dequantised())


@pytest.mark.parametrize(("change", "key", "says"), [
    (["trainer.precision=32-true"], "model.lora.base_dtype",
     "keep with trainer.precision=32-true, or trainer.precision=bf16-mixed"),
    (["parallel=zero3", "trainer.devices=2"], "model.lora.base_dtype",
     "keep or bfloat16 with dp_shard=2 zero3; nf4 runs on one process or under parallel=ddp"),
    (["parallel=tp", "trainer.devices=2"], "model.lora.base_dtype", "keep or bfloat16 with tp=2"),
    (["parallel=pipeline", "trainer.devices=2"], "model.lora.base_dtype", "keep or bfloat16 with pp=2"),
    (["model.lora.dora=true"], "model.lora.dora", "false with model.lora.base_dtype=nf4"),
    (["model.n_embd=32"], "model.lora.base_dtype", "input width is a multiple of 64, and blocks.0.attn.q has 32"),
])
def test_an_nf4_setting_the_run_cannot_take_is_one_line(make_config, change, key, says):
    with pytest.raises(ConfigError, match=rf"^{key}=.* is invalid: .*{says}"):
        validate(make_config([*WIDE, *NF4, *change]))


def test_nf4_without_bitsandbytes_names_the_extra(make_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"^model\.lora\.base_dtype='nf4' is invalid: .*pip install "
                                          r"'disttrain\[finetune\]'"):
        validate(make_config([*WIDE, *NF4]))


def test_nf4_layer_rejects_a_weight_of_another_shape():
    layer = NF4Linear(torch.nn.Linear(2 * BLOCK_SIZE, 4))
    with pytest.raises(RuntimeError, match="shape"):
        layer.load_state_dict({"weight": torch.zeros(4, BLOCK_SIZE), "bias": torch.zeros(4)})


def test_the_quant_state_follows_the_codes_to_their_device_and_keeps_its_dtype():
    """bitsandbytes' kernels read the blocks' absmax by pointer, unchecked: moving the layer moves its quant state
    with the codes (here to the meta device, the other device a CPU has; on a GPU machine, a layer quantised on the
    CPU and then moved), and a dtype conversion of the module leaves the codes uint8 and the absmax fp32, the
    dtypes those kernels take."""
    layer = NF4Linear(torch.nn.Linear(2 * BLOCK_SIZE, 4, bias=False))
    x = torch.randn(3, 2 * BLOCK_SIZE, generator=torch.Generator().manual_seed(0))
    before = layer(x)
    layer.to(torch.float16)
    assert (layer.weight.dtype, layer.quant_state.absmax.dtype) == (torch.uint8, torch.float32)
    assert torch.equal(layer(x), before)
    layer.to("meta")
    held = {"codes": layer.weight, "absmax": layer.quant_state.absmax, "code book": layer.quant_state.code}
    assert {name: tensor.device.type for name, tensor in held.items()} == dict.fromkeys(held, "meta")


def test_a_double_quantised_layer_computes_with_its_dequantised_weight_and_holds_its_scales_in_8_bits():
    """QLoRA's double quantisation: the same 4-bit codes, the blocks' absmax held as 8-bit codes in nested blocks
    with one fp32 absmax each and one fp32 offset; the layer's product is the dequantised weight's, and it holds
    what plain nf4 holds less 3 of each absmax's 4 bytes, plus the nested blocks' scales and the offset."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(4 * BLOCK_SIZE, 128)  # 512 blocks: two nested blocks of 256
    plain, double = NF4Linear(linear), NF4Linear(linear, NF4Format(double_quant=True))
    state = double.quant_state
    assert state.nested and not plain.quant_state.nested and state.absmax.dtype == torch.uint8
    assert torch.equal(double.weight, plain.weight)  # the codes are quantised with the exact absmax
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(1))
    weight = double.dequantised()
    assert not torch.equal(weight, plain.dequantised())  # its scales are the 8-bit ones, not plain's
    expected = F.linear(x.to(torch.bfloat16), weight, linear.bias.detach().to(torch.bfloat16))
    torch.testing.assert_close(double(x), expected.float(), rtol=1e-2, atol=1e-3)
    print(f"held bits per weight: nf4 {8 * plain.held_bytes() / plain.weights:.4f}, double-quantised "
          f"{8 * double.held_bytes() / double.weights:.4f}")
    assert plain.held_bytes() - double.held_bytes() == double_quant_saving(double) > 0


def test_a_double_quantised_state_follows_its_codes_to_the_meta_device_and_back_to_a_cpu(monkeypatch):
    """The nested state (8-bit absmax, their scales, code book and the offset) moves with the codes; and a first
    double-quantised layer on the meta device (the planner's pass) leaves bitsandbytes' 8-bit map usable by a
    layer quantised on a CPU after it."""
    from bitsandbytes import functional

    monkeypatch.delitem(functional.name2qmap, "dynamic", raising=False)  # as a fresh process has it
    on_meta = NF4Linear(torch.nn.Linear(4 * BLOCK_SIZE, 4, bias=False, device="meta"), NF4Format(double_quant=True))
    layer = NF4Linear(torch.nn.Linear(4 * BLOCK_SIZE, 4, bias=False), NF4Format(double_quant=True))
    assert layer.quant_state.state2.absmax.device.type == "cpu" and on_meta.weight.is_meta
    layer.to("meta")
    state = layer.quant_state
    held = {"codes": layer.weight, "absmax": state.absmax, "code book": state.code, "offset": state.offset,
            "nested absmax": state.state2.absmax, "nested code book": state.state2.code}
    assert {name: tensor.device.type for name, tensor in held.items()} == dict.fromkeys(held, "meta")


@pytest.mark.parametrize(("lora", "says"), [(BF16, "base_dtype is bfloat16"),
                                            ([], "model.lora.rank is null: no adapters")])
def test_double_quant_without_an_nf4_base_is_one_line(make_config, lora, says):
    with pytest.raises(ConfigError, match=r"^model\.lora\.double_quant=true is invalid: false unless the base is "
                                          rf"held in nf4 .*; {says}\)$"):
        validate(make_config([*WIDE, *lora, "model.lora.double_quant=true"]))


LEARN = [*WIDE, *FAMILIES["sgd"], "trainer.max_steps=12", "trainer.val_check_interval=12"]
"""A dozen steps of plain SGD: the adapters' random start puts the loss well above what they reach."""


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> dict:
    return run_summary(tmp_path_factory.mktemp("bf16"), [*LEARN, *BF16])


@pytest.fixture(scope="module")
def nf4_run(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("nf4")
    return {"run_dir": run_dir, **run_summary(run_dir, [*LEARN, *NF4])}


def frozen_base(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in weights.items() if ".base_layer.weight" in name}


@pytest.mark.slow
def test_a_qlora_run_learns_keeps_its_base_and_starts_where_the_bf16_base_does(nf4_run, bf16_run):
    """The loss falls; the checkpoint's base is the bf16 run's base quantised and dequantised (the nf4 run's base
    never changed); the first step's loss is the bf16 base's within the quantisation error. The nf4 run comes
    first: a later run in the same process may save under the earlier one's cached checkpoint plan, dtypes and
    all (torch's ``enable_plan_caching``)."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    losses = nf4_run["losses"]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.1, losses
    assert abs(losses[0] - bf16_run["losses"][0]) <= FIRST_LOSS_ATOL, (losses[0], bf16_run["losses"][0])
    bases, reference = frozen_base(nf4_run["weights"]), frozen_base(bf16_run["weights"])
    assert bases.keys() == reference.keys() and bases
    for name, weight in bases.items():
        assert weight.dtype == torch.bfloat16, name  # dequantised, not the codes
        codes, state = quantize_4bit(reference[name], blocksize=BLOCK_SIZE, quant_type="nf4")
        assert torch.equal(weight, dequantize_4bit(codes, state)), name
    assert abs(nf4_run["exported_val_loss"] - nf4_run["val_loss"]) <= 1e-3


@pytest.mark.slow
def test_a_qlora_runs_merged_export_starts_a_run_without_adapters_at_its_loss(tmp_path, nf4_run):
    """Merging dequantises: the merged safetensors export holds each adapted projection as the checkpoint's bf16
    base (the nf4 codes dequantised) plus the adapters' product, rounded to bf16 once; a run without adapters
    from it (bf16-mixed, as the QLoRA run) scores the QLoRA run's last validation loss within that rounding."""
    from safetensors.torch import load_file

    from disttrain.launch.job import train
    from disttrain.models.lora import base_name
    from tests.conftest import compose_config, logged_metric
    from tests.test_export_safetensors import export_status

    merged_file = tmp_path / "merged.safetensors"
    assert export_status(nf4_run["run_dir"], "--format", "safetensors", merged_file) == 0
    merged, held = load_file(merged_file), nf4_run["weights"]
    bases = frozen_base(held)
    assert set(merged) == {base_name(name) for name in held if not is_adapter(name)} and bases
    for name, base in bases.items():
        module = name.removesuffix(".base_layer.weight")
        product = held[f"{module}.lora_B.default.weight"] @ held[f"{module}.lora_A.default.weight"]
        assert merged[base_name(name)].dtype == torch.bfloat16, name
        assert torch.equal(merged[base_name(name)], (base.float() + product).to(torch.bfloat16)), name  # scale 1
    next_run = [*LEARN, "trainer.precision=bf16-mixed", "trainer.max_steps=1", "trainer.val_check_interval=1",
                "trainer.validate_before_training=true", f"model.init_weights={merged_file}"]
    train(compose_config(next_run, tmp_path / "next"))
    step, first_val = logged_metric(tmp_path / "next", "val/loss")[0]
    assert step == 0
    assert abs(first_val - nf4_run["val_loss"]) <= MERGED_NF4_LOSS_ATOL, (first_val, nf4_run["val_loss"])


@pytest.mark.slow
def test_qlora_under_ddp_matches_one_process(tmp_path, nf4_run):
    got = run_summary(tmp_path / "ddp", [*LEARN, *NF4, "parallel=ddp", "trainer.devices=2"])
    deviation = max(abs(a - b) / abs(a) for a, b in zip(nf4_run["losses"], got["losses"], strict=True))
    assert deviation <= 1e-3, deviation
    for name, weight in frozen_base(got["weights"]).items():
        assert torch.equal(weight, nf4_run["weights"][name]), name


@pytest.mark.slow
def test_a_resumed_qlora_run_goes_on_from_the_same_codes(tmp_path):
    """Four steps, resumed for four more, follow eight straight steps (losses, adapters, base); resumed instead
    into a model built from another seed, the base is still the straight run's: the checkpoint's dequantised base
    is quantised back to the codes it came from."""
    from disttrain.checkpoint.export import consolidated_weights
    from tests.test_run import step_losses

    straight_and_resumed(NF4, tmp_path)
    reference = consolidated_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    reseeded = frozen_base(consolidated_weights(tmp_path / "reseeded" / "checkpoints" / "last.ckpt"))
    assert reseeded and all(torch.equal(weight, reference[name]) for name, weight in reseeded.items())
    final = consolidated_weights(tmp_path / "more" / "checkpoints" / "last.ckpt")
    for name, weight in final.items():
        torch.testing.assert_close(weight, reference[name], rtol=0, atol=1e-5 if is_adapter(name) else 0, msg=name)
    straight, more = step_losses(tmp_path / "straight"), step_losses(tmp_path / "more")
    assert max(abs(a - b) / abs(a) for a, b in zip(straight[4:], more, strict=True)) <= 1e-5


DOUBLE_RESUME_BASE_ATOL = 0.02
"""The largest change of a double-quantised base weight over a save and resume, over the layer's largest weight:
its 4-bit codes come back, its block's absmax within the 8-bit rounding of the nested blocks: measured 4.3e-3."""
DOUBLE_RESUME_LOSS_RTOL = 2e-4
"""A resumed double-quantised run's losses against the straight run's, relative: measured 1.4e-5."""


@pytest.mark.slow
def test_a_resumed_double_quantised_run_goes_on_from_the_same_4bit_codes(tmp_path):
    """Double quantisation (``model.lora.double_quant``) saves and resumes: the checkpoint holds the base
    dequantised (bf16), as plain nf4's; a resume quantises it back to the same 4-bit codes, whatever model it is
    resumed into (the base is the checkpoint's, not the built one's), with each block's absmax within the 8-bit
    rounding of the nested blocks, so four steps resumed for four more follow eight straight steps closely."""
    from bitsandbytes.functional import quantize_4bit

    from disttrain.checkpoint.export import consolidated_weights
    from tests.test_run import step_losses

    straight_and_resumed(DOUBLE, tmp_path)

    def bases(name: str) -> dict[str, torch.Tensor]:
        return frozen_base(consolidated_weights(tmp_path / name / "checkpoints" / "last.ckpt"))

    straight, resumed, reseeded = bases("straight"), bases("more"), bases("reseeded")
    assert straight and resumed.keys() == straight.keys() == reseeded.keys()
    worst = 0.0
    for name, weight in resumed.items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, reseeded[name]), name

        def codes(tensor: torch.Tensor) -> torch.Tensor:
            return quantize_4bit(tensor, blocksize=BLOCK_SIZE, quant_type="nf4", compress_statistics=True)[0]

        assert torch.equal(codes(weight), codes(straight[name])), name
        worst = max(worst, ((weight.float() - straight[name].float()).abs().max()
                            / straight[name].float().abs().max()).item())
    losses, more = step_losses(tmp_path / "straight"), step_losses(tmp_path / "more")
    loss_gap = max(abs(a - b) / abs(a) for a, b in zip(losses[4:], more, strict=True))
    print(f"double-quantised resume: base change {worst:.3g} of the largest weight, losses {loss_gap:.3g} relative")
    assert worst <= DOUBLE_RESUME_BASE_ATOL and loss_gap <= DOUBLE_RESUME_LOSS_RTOL


@pytest.mark.slow
def test_a_qlora_run_from_a_folder_quantises_its_weights_and_exports_them_dequantised(tmp_path):
    """A Hugging Face Llama started from a folder: the checkpoint's base is the folder's weights quantised and
    dequantised (the folder is read before the layers are quantised), and the merged export (``--format hf``)
    gives the logits of the run's own model read back from its checkpoint."""
    import transformers
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit
    from safetensors.torch import load_file

    from disttrain.checkpoint.export import consolidated_weights, export_hf
    from disttrain.generate.loading import load_run
    from disttrain.launch.job import train
    from disttrain.models.lora import base_name
    from tests.conftest import compose_config
    from tests.test_hf_models import saved_folder
    from tests.test_lora import HF_LLAMA

    folder = saved_folder(tmp_path / "hf")
    run_dir = tmp_path / "run"
    train(compose_config([*HF_LLAMA, f"model.path={folder}", "model.pretrained=true", *NF4, "trainer.max_steps=3"],
                         run_dir))
    saved = load_file(folder / "model.safetensors")
    bases = frozen_base(consolidated_weights(run_dir / "checkpoints" / "last.ckpt"))
    assert bases
    for name, weight in bases.items():
        codes, state = quantize_4bit(saved[base_name(name)].to(torch.bfloat16), blocksize=BLOCK_SIZE,
                                     quant_type="nf4")
        assert torch.equal(weight, dequantize_4bit(codes, state)), name
    loaded = load_run(run_dir, "last")
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded.model(tokens)
        merged = transformers.AutoModelForCausalLM.from_pretrained(export_hf(run_dir, tmp_path / "merged"),
                                                                   local_files_only=True).eval()
        # the merged projections are bf16 (the checkpoint's base), so the merge rounds the adapters' product to bf16:
        # measured 5.7e-3 at most on logits of about unit scale
        torch.testing.assert_close(merged(tokens).logits.float(), ours.float(), rtol=0, atol=2e-2)


def straight_and_resumed(quantised: list[str], tmp_path: Path) -> None:
    """Runs of the wide GPT with its base held as ``quantised`` says, under ``tmp_path``: ``straight`` (8 steps),
    ``first`` (4), and ``more`` and ``reseeded`` (``seed=1``), each resumed from ``first`` to step 8."""
    from disttrain.launch.job import train
    from tests.conftest import compose_config

    run = [*(o for o in WIDE if not o.startswith(("optim", "trainer.max_steps", "trainer.val_check"))),
           "optim=adamw", "optim.lr=0.01", "trainer.val_check_interval=4", *quantised, "scheduler=constant",
           "scheduler.warmup_fraction=null", "scheduler.warmup_steps=0"]
    train(compose_config([*run, "trainer.max_steps=8"], tmp_path / "straight"))
    train(compose_config([*run, "trainer.max_steps=4"], tmp_path / "first"))
    for name, more in (("more", []), ("reseeded", ["seed=1"])):
        train(compose_config([*run, "trainer.max_steps=8", *more, f"resume={tmp_path / 'first'}"], tmp_path / name))

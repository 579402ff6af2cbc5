"""Hugging Face format: a run's llama checkpoint exported and loaded by transformers, an HF Llama folder
imported into the built-in llama, and folders the built-in llama cannot compute refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig

from disttrain.checkpoint.export import export
from disttrain.checkpoint.hf import write_hf_folder
from disttrain.checkpoint.io import load_weights_file
from disttrain.config import validate
from disttrain.data import build_datamodule
from disttrain.errors import ConfigError
from disttrain.launch.job import train
from disttrain.models import build_model
from disttrain.models.llama import Llama, LlamaDims
from disttrain.models.llama_hf import (
    SIZES,
    from_hf_state_dict,
    hf_config,
    hf_names,
    import_hf_llama,
    read_hf_llama,
    to_hf_state_dict,
)
from tests.conftest import ROOT
from tests.test_export_safetensors import export_status

TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.n_kv_head=2"]
LLAMA_RUN = [
    "model=llama", "model.flavour=micro", *TINY, "data=pydocs", "data.block_size=32", "batch.global_size=8",
    "trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.run_test=false", "logger=csv", "callbacks=none",
]
DIMS = LlamaDims(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=256, mlp_hidden=192)
SEEDED_DIMS = LlamaDims(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32, vocab_size=256, mlp_hidden=160)
"""The sizes of ``seeded_hf_llama``'s model."""


def batch() -> torch.Tensor:
    return torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))


def export_cli(*args: str | Path) -> subprocess.CompletedProcess:
    """``python -m disttrain.checkpoint.export *args`` as a user runs it, with the network switched off."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "disttrain.checkpoint.export", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize(("layout", "source", "shard"), [
    ([], "run", "5GB"),  # one process, the run directory named, one model.safetensors
    (["parallel=zero3", "trainer.devices=2"], "checkpoint", "100KB"),  # two ranks' shards, sharded safetensors
])
def test_a_run_exports_to_hf_and_transformers_computes_the_same_logits(make_config, tmp_path, layout, source, shard):
    run_dir = tmp_path / "run"
    train(make_config([*LLAMA_RUN, *layout], run_dir))
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    out = tmp_path / "hf"
    done = export_cli(run_dir if source == "run" else checkpoint, "--format", "hf", out, "--max-shard-size", shard)
    assert done.returncode == 0, done.stderr
    files = sorted(path.name for path in out.iterdir())
    if shard == "5GB":
        assert files == ["config.json", "generation_config.json", "model.safetensors"]
    else:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and shards[0].startswith("model-00001-of-") and set(shards) < set(files)
    assert not list(tmp_path.glob("hf.*"))  # no staging folder left beside it
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["max_position_embeddings"] == 32
    assert (config["num_key_value_heads"], config["intermediate_size"], config["vocab_size"]) == (2, 192, 256)

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(hf, LlamaForCausalLM) and hf.dtype == torch.float32
    cfg = OmegaConf.load(run_dir / "config.yaml")
    run = validate(cfg, world_size=cfg.trainer.devices)
    model = build_model(run.model, build_datamodule(run.data, 1, 0).spec).eval()
    # the default format through the same command, from a run directory or a checkpoint folder alike
    assert export_status(run_dir if source == "run" else checkpoint, tmp_path / "model.pt") == 0
    model.load_state_dict(load_weights_file(tmp_path / "model.pt"), strict=True)
    with torch.no_grad():
        assert max_diff(hf(batch()).logits, model(batch())) <= 1e-5

    # exporting again replaces the folder whole
    assert export_status(checkpoint, "--format", "hf", out) == 0
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_models_without_an_hf_format_are_refused(make_config, tmp_path):
    run_dir = tmp_path / "gpt"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(make_config(["model=gpt"], run_dir)))
    done = export_cli(run_dir, "--format", "hf", tmp_path / "hf")
    assert done.returncode != 0 and not (tmp_path / "hf").exists()
    assert "model.name='gpt' is invalid: one of ['llama', 'hf']" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_builtin_to_hf_and_back_is_exact(tmp_path):
    torch.manual_seed(0)
    model = Llama(DIMS)
    for param in model.parameters():  # norms too, so a swapped pair of names would show
        param.data.normal_()
    sizes = {key: getattr(DIMS, key) for key in SIZES}
    write_hf_folder(hf_config(sizes, 32, 10000.0, 1e-5), to_hf_state_dict(model.state_dict(), 4, 2), tmp_path / "hf")
    hf, state = read_hf_llama(tmp_path / "hf"), import_hf_llama(tmp_path / "hf", model.state_dict())
    assert hf.sizes == sizes and (hf.rope_theta, hf.norm_eps, hf.tied) == (10000.0, 1e-5, False)
    original = model.state_dict()
    assert state.keys() == original.keys()
    assert all(torch.equal(state[name], original[name]) for name in original)
    # the permutation is a real one: queries and keys differ in the HF layout, other tensors do not
    hf_state = to_hf_state_dict(original, 4, 2)
    assert not torch.equal(hf_state["model.layers.0.self_attn.q_proj.weight"], original["layers.0.attention.q.weight"])
    assert torch.equal(hf_state["model.layers.0.self_attn.v_proj.weight"], original["layers.0.attention.v.weight"])
    assert from_hf_state_dict(hf_state, hf_names(original, hf_state, tied=False), 4, 2).keys() == original.keys()


def seeded_hf_llama(folder: Path, tied: bool = False, **overrides) -> LlamaForCausalLM:
    """A tiny transformers Llama with seeded random weights, saved into ``folder``."""
    torch.manual_seed(3)
    fields = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": tied}
    model = LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():  # larger than transformers' init, norm gains away from 1, so every mapping error shows
        for param in model.parameters():
            param.normal_(mean=1.0 if param.ndim == 1 else 0.0, std=0.1)
    model.save_pretrained(folder)
    return model


HF_SETTINGS = ["model.rope_theta=500000.0", "model.norm_eps=1e-6"]


@pytest.mark.parametrize("tied", [False, True])
def test_init_from_an_hf_llama_gives_transformers_logits(make_config, tmp_path, tied):
    hf = seeded_hf_llama(tmp_path / "hf", tied=tied)
    cfg = make_config(["model=llama", "data=pydocs", "data.block_size=32", f"model.init_from={tmp_path / 'hf'}",
                       *HF_SETTINGS])
    run = validate(cfg)
    model = build_model(run.model, run.datamodule.spec).eval()  # what a rank does before any parallelism
    assert (model.dims.n_embd, model.dims.mlp_hidden, model.dims.block_size) == (64, 160, 32)  # not the flavour's
    with torch.no_grad():
        assert max_diff(model(batch()), hf(batch()).logits) <= 1e-5


def test_a_run_starts_from_an_hf_llama(make_config, tmp_path):
    """A real run with ``model.init_from`` ends two optimiser steps from the HF model's weights."""
    seeded_hf_llama(tmp_path / "hf")
    train(make_config([*LLAMA_RUN, f"model.init_from={tmp_path / 'hf'}", *HF_SETTINGS], tmp_path / "run"))
    weights = load_weights_file(export(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "model.pt"))
    imported = import_hf_llama(tmp_path / "hf", weights)
    # the imported weights moved by two small steps; a fresh model (N(0, 0.02), unit norms) is ~1 away from them
    assert max(max_diff(weights[name], imported[name]) for name in imported) < 0.05


@pytest.mark.parametrize(("change", "named"), [
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}}, "rope_type='linear'"),
    ({"head_dim": 32}, "head_dim=32"),
])
def test_an_hf_folder_the_builtin_llama_cannot_compute_is_refused(make_config, tmp_path, change, named):
    seeded_hf_llama(tmp_path / "hf", **change)
    cfg = make_config(["model=llama", "data=pydocs", f"model.init_from={tmp_path / 'hf'}", *HF_SETTINGS])
    with pytest.raises(ConfigError, match="model.init_from=") as err:
        validate(cfg)
    assert named in str(err.value)


def test_init_from_mismatches_are_config_errors(make_config, tmp_path):
    seeded_hf_llama(tmp_path / "hf")
    MistralConfig(vocab_size=256, hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path / "mistral")
    hf = f"model.init_from={tmp_path / 'hf'}"
    cases = [
        ([hf, *HF_SETTINGS, "model.n_layer=3"], "model.n_layer=3 is invalid: 2"),
        ([hf, "model.norm_eps=1e-6"], "model.rope_theta=10000.0 is invalid: 500000.0"),
        ([f"model.init_from={tmp_path / 'mistral'}"], "has model_type 'mistral'"),
        ([f"model.init_from={tmp_path / 'nothing'}"], "a folder with a Hugging Face config.json"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            validate(make_config(["model=llama", "data=pydocs", *overrides]))


def _sharded(index_text: str):
    """The folder's weights as one shard beside an index of the given text."""
    def change(folder: Path) -> None:
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
        (folder / "model.safetensors.index.json").write_text(index_text)

    return change


def _cut_short(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _rewritten(change):
    """A change to the folder's tensors (a dict by HF name), saved back over its ``model.safetensors``."""
    def rewrite(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    return rewrite


BAD_LLAMA_WEIGHTS = {
    "index-not-json": (_sharded("{oops"), "its model.safetensors.index.json is not JSON (Expecting property name"),
    "index-names-missing-shard": (
        _sharded(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})),
        "its model.safetensors.index.json names model-00002-of-00002.safetensors, which is not there"),
    "shard-cut-short": (_cut_short, "model.safetensors is cut short by 100 bytes ("),
    "missing-tensor": (_rewritten(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       "it lacks model.layers.1.mlp.up_proj.weight (the model's layers.1.feed_forward.w3.weight), "
                       "of shape [160, 64]"),
    "extra-tensor": (_rewritten(lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(64)})),
                     "model.safetensors holds model.layers.2.input_layernorm.weight, which the model has not (the "
                     "model's first: model.embed_tokens.weight)"),
    "wrong-shape": (_rewritten(lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(64, 64)})),
                    "model.safetensors holds model.layers.0.self_attn.k_proj.weight as [64, 64], where the model's "
                    "layers.0.attention.k.weight is [32, 64]"),
    "integer-dtype": (_rewritten(lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})),
                      "model.safetensors holds model.norm.weight as I32, which does not cast to the model's "
                      "norm.weight, float32 (one of F16, BF16, F32, F64, F8_E4M3, F8_E5M2)"),
}


@pytest.mark.parametrize("case", list(BAD_LLAMA_WEIGHTS))
def test_init_from_weights_that_do_not_fit_are_one_line_before_any_rank(make_config, tmp_path, case):
    """An index that is not JSON or names a shard the folder lacks, a shard cut short, a tensor the model lacks or
    the folder lacks, one of another shape or of a dtype that does not cast: refused in one line naming
    ``model.init_from``, the folder, the tensor and what the model expects while the job validates, from the
    headers alone; a rank's read of the tensors refuses it in the same line before reading any."""
    change, expected = BAD_LLAMA_WEIGHTS[case]
    folder = tmp_path / "hf"
    seeded_hf_llama(folder)
    change(folder)
    with pytest.raises(ConfigError) as checked:
        validate(make_config(["model=llama", "data=pydocs", f"model.init_from={folder}", *HF_SETTINGS]))
    line = str(checked.value)
    assert line.startswith(f"model.init_from='{folder}' is invalid: an HF Llama folder whose safetensors "
                           "weights are whole and fit the model; ") and expected in line and "\n" not in line, line
    with pytest.raises(ConfigError) as read:
        import_hf_llama(folder, Llama(SEEDED_DIMS).state_dict())
    assert str(read.value) == line


def test_init_from_leaves_the_rotary_buffers_of_older_checkpoints_alone(make_config, tmp_path):
    """Older HF checkpoints saved each layer's ``rotary_emb.inv_freq``: recomputed from the config, neither read
    nor refused, by the job's check and by a rank's read."""
    folder = tmp_path / "hf"
    seeded_hf_llama(folder)
    _rewritten(lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                                   for i in range(2)}))(folder)
    validate(make_config(["model=llama", "data=pydocs", f"model.init_from={folder}", *HF_SETTINGS]))
    model = Llama(SEEDED_DIMS)
    assert import_hf_llama(folder, model.state_dict()).keys() == model.state_dict().keys()

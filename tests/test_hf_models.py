"""Hugging Face models (``model=hf``) through the real runner: parity with one process under every layout their
declared plan qualifies them for, their own forward and loss, starting from a saved folder, and refusals.

Llama- and Qwen3-family models are built from a config (2 layers, seeded) and compared with one process as the
parity suite compares the built-in GPT (``tests/test_parity.py``): plain SGD, where a wrong gradient scale moves
every weight, and for tensor parallelism also clipping that binds on every step, where a wrong global norm (or
a per-head norm's gradient not summed over the tp ranks) changes every update.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from tests.test_parity import BASE as GPT_BASE  # noqa: E402
from tests.test_parity import FAMILIES, check_against, run_summary  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}
ARCHS = {"llama": TINY, "qwen3": {**TINY, "head_dim": 16}}
GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0}  # dropout draws its masks per rank: off, for curves that can be equal
# measured (fp32, gloo, lr 0.5 plain SGD, whose loss spikes on these models): losses within 1.0e-6 relative of one
# process (Qwen3 on dp_shard 2 x tp 2), final weights within 1.4e-6 absolute (Llama's embedding under tp); the GPT
# parity suite's model stays within 2.3e-7 and 1.2e-7. A wrong gradient scale or norm moves them by 1e-3 or more.
LOSS_RTOL, WEIGHT_ATOL = 2e-6, 3e-6


def hf_overrides(arch: str, fields: dict) -> list[str]:
    """``model=hf`` built from ``arch`` and ``fields`` (the parity suite's data, batch, optimiser and length)."""
    model = [o for o in GPT_BASE if not o.startswith("model.")]
    model = [o if o != "model=gpt" else "model=hf" for o in model]
    return [*model, f"model.arch={arch}", *(f"+model.{key}={value}" for key, value in fields.items())]


LAYOUTS = {
    "ddp": (["parallel=ddp"], 2),
    "zero3": (["parallel=zero3"], 2),
    "tp": (["parallel=tp"], 2),
    "pp": (["parallel=pipeline", "parallel.pipeline.schedule=1f1b"], 2),
    "dp_shard2xtp2": (["parallel=hybrid", "parallel.tp=2"], 4),
}
CASES = [("llama", "sgd", "zero3"), ("llama", "sgd", "tp"), ("llama", "sgd", "pp"), ("llama", "sgd+clip", "tp"),
         ("qwen3", "sgd", "tp"), ("qwen3", "sgd+clip", "tp"), ("qwen3", "sgd", "dp_shard2xtp2"),
         ("qwen3", "sgd", "pp")]
SLOW_CASES = [("llama", "sgd", "ddp"), ("llama", "sgd", "dp_shard2xtp2"), ("qwen3", "sgd", "zero3"),
              ("qwen3", "sgd", "ddp")]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """One process per model and family, computed when first asked for."""
    cache: dict[tuple[str, str], dict] = {}

    def reference(arch: str, family: str) -> dict:
        if (arch, family) not in cache:
            cache[arch, family] = run_summary(tmp_path_factory.mktemp(f"{arch}-single"),
                                              [*hf_overrides(arch, ARCHS[arch]), *FAMILIES[family]])
        return cache[arch, family]

    return reference


def check_layout(tmp_path: Path, references, arch: str, family: str, layout: str) -> None:
    overrides, ranks = LAYOUTS[layout]
    got = run_summary(tmp_path / "run", [*hf_overrides(arch, ARCHS[arch]), *FAMILIES[family], *overrides,
                                         f"trainer.devices={ranks}"])
    check_against(references(arch, family), got, clipped=family == "sgd+clip", loss_rtol=LOSS_RTOL,
                  weight_atol=WEIGHT_ATOL)


@pytest.mark.parametrize(("arch", "family", "layout"), CASES)
def test_hf_model_matches_one_process(tmp_path, references, arch, family, layout):
    check_layout(tmp_path, references, arch, family, layout)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "family", "layout"), SLOW_CASES)
def test_hf_model_matches_one_process_in_more_layouts(tmp_path, references, arch, family, layout):
    check_layout(tmp_path, references, arch, family, layout)


def test_gpt2_without_a_plan_trains_data_parallel_and_is_refused_tensor_parallel(tmp_path, make_config):
    reference = run_summary(tmp_path / "single", [*hf_overrides("gpt2", GPT2), *FAMILIES["sgd"]])
    for layout in ("ddp", "zero3"):
        got = run_summary(tmp_path / layout, [*hf_overrides("gpt2", GPT2), *FAMILIES["sgd"], f"parallel={layout}",
                                              "trainer.devices=2"])
        check_against(reference, got, clipped=False, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL)
    with pytest.raises(ConfigError, match=r"parallel\.tp.*declares no tp_plan"):
        validate(make_config([*hf_overrides("gpt2", GPT2), "parallel=tp", "trainer.devices=2"]))


def saved_folder(folder: Path, arch: str = "llama") -> Path:
    """A seeded random ``arch`` model of ``ARCHS`` saved with ``save_pretrained`` (config.json, safetensors)."""
    import transformers

    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model(arch, vocab_size=256, **ARCHS[arch])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("layout", ["single", "zero3", "tp", "pp"])
def test_a_pretrained_folder_starts_where_transformers_is(tmp_path, layout):
    """A run started from a saved folder (allocated and read shard by shard under ZeRO-3, slice by slice under
    tp, stage by stage in a pipeline) validates before its first step (``trainer.validate_before_training``),
    logged at step 0, to ``transformers``' own loss of that folder on the same windows (``labels`` shift)."""
    folder = saved_folder(tmp_path / "hf")
    overrides = [o for o in hf_overrides("llama", {}) if not o.startswith("model.arch")]
    if layout != "single":
        overrides += [*LAYOUTS[layout][0], f"trainer.devices={LAYOUTS[layout][1]}"]
    val_loss, expected = starting_losses(folder, overrides, tmp_path / "run")
    assert val_loss == pytest.approx(expected, rel=1e-6)


def starting_losses(folder: Path, overrides: list[str], run_dir: Path) -> tuple[float, float]:
    """The validation loss a run of ``overrides`` started from ``folder`` logs at step 0, and ``transformers``'
    own loss of ``from_pretrained(folder)`` on the same windows (``labels`` shift)."""
    import transformers

    from disttrain.launch.job import train
    from tests.conftest import compose_config, logged_metric

    overrides = [*overrides, f"model.path={folder}", "model.pretrained=true", "trainer.max_steps=1",
                 "trainer.validate_before_training=true"]
    cfg = compose_config(overrides, run_dir)
    run = validate(cfg.copy())
    train(cfg)
    val_loss = dict(logged_metric(run_dir, "val/loss"))[0]
    val = run.datamodule.datasets["val"]
    count = min(len(val), run.train.trainer.limit_val_batches * run.batch.micro_size * run.dims.dp)
    inputs, targets = (torch.stack(part) for part in zip(*(val[i] for i in range(count)), strict=True))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True,
                                                               attn_implementation="sdpa")
    tokens = torch.cat([inputs, targets[:, -1:]], dim=1)  # the targets are the inputs moved on by one token
    with torch.no_grad():
        expected = model(input_ids=tokens, labels=tokens).loss.item()
    return val_loss, expected


def test_precision_auto_times_a_model_that_starts_from_a_folder(make_config, tmp_path):
    """A model built on the meta device (its weights come later) is timed with weights of its own."""
    folder = saved_folder(tmp_path / "hf")
    base = [o for o in hf_overrides("llama", {}) if not o.startswith("model.arch")]
    run = validate(make_config([*base, f"model.path={folder}", "model.pretrained=true", "trainer.precision=auto",
                                "trainer.accelerator=cpu"]))
    assert run.train.trainer.precision in ("32-true", "bf16-mixed")


def test_bad_hf_configs_are_one_line(make_config, tmp_path):
    base = [o for o in hf_overrides("llama", {}) if not o.startswith("model.arch")]
    with pytest.raises(ConfigError, match=r"model\.path.*exactly one"):
        validate(make_config(base))
    with pytest.raises(ConfigError, match=r"model\.arch.*transformers model type"):
        validate(make_config([*base, "model.arch=llamma"]))
    with pytest.raises(ConfigError, match=r"model\.hiden_size.*a field of LlamaConfig"):
        validate(make_config([*base, "model.arch=llama", "+model.hiden_size=64"]))
    with pytest.raises(ConfigError, match=r"model\.path.*config\.json"):
        validate(make_config([*base, f"model.path={tmp_path}"]))
    with pytest.raises(ConfigError, match=r"model\.vocab_size.*256"):
        validate(make_config([*base, "model.arch=llama", "+model.vocab_size=100", *(
            f"+model.{k}={v}" for k, v in TINY.items())]))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY, "vocab_size": 256}))
    with pytest.raises(ConfigError, match=r"model\.path.*safetensors"):
        validate(make_config([*base, f"model.path={tmp_path}", "model.pretrained=true"]))


def test_an_unknown_model_type_names_close_ones_not_all(make_config, tmp_path):
    """transformers knows hundreds of model types: the error names the value, a few spelled like it and how to list
    them all, rather than every one (several KB)."""
    base = [o for o in hf_overrides("llama", {}) if not o.startswith("model.arch")]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "lama", **TINY, "vocab_size": 256}))
    for override, key in (("model.arch=lama", "model.arch='lama'"), (f"model.path={tmp_path}", "model.path=")):
        with pytest.raises(ConfigError) as refused:
            validate(make_config([*base, override]))
        message = str(refused.value)
        assert message.startswith(key) and "'lama'" in message and "close to it: llama" in message, message
        assert "sorted(transformers.CONFIG_MAPPING)" in message and len(message) < 400, message


WEIGHTS = "model.safetensors"
SHARD = "model-00001-of-00001.safetensors"


def _rewritten(change):
    """A change to the folder's tensors, saved back over its ``model.safetensors``."""
    def rewrite(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / WEIGHTS)
        change(tensors)
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})

    return rewrite


def _indexed(text: str):
    """The folder's weights as one shard beside an index of the given text."""
    def index(folder: Path) -> None:
        (folder / WEIGHTS).rename(folder / SHARD)
        (folder / "model.safetensors.index.json").write_text(text)

    return index


BAD_FOLDERS = {
    "cut-short": (lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes()[:-100]),
                  [f"{WEIGHTS} is cut short by 100 bytes (", "where its header's tensors end at byte"]),
    "garbage-header": (lambda f: (f / WEIGHTS).write_bytes(b"\x20" + bytes(7) + b"{not json" + bytes(100)),
                       [f"{WEIGHTS} is not a safetensors file", "invalid JSON in header"]),
    "wrong-shape": (_rewritten(lambda t: t.update({"model.norm.weight": torch.ones(32)})),
                    [f"{WEIGHTS} holds model.norm.weight as [32], where the model's is [64]"]),
    "missing-tensor": (_rewritten(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                       ["it lacks model.layers.1.mlp.up_proj.weight, of shape [128, 64]"]),
    "integer-dtype": (_rewritten(lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})),
                      [f"{WEIGHTS} holds model.norm.weight as I32, which does not cast to the model's float32"]),
    "index-not-json": (_indexed("{oops"), ["its model.safetensors.index.json is not JSON (Expecting"]),
    "index-without-weight-map": (_indexed('{"metadata": {}}'),
                                 ["its model.safetensors.index.json has no weight_map"]),
    "index-names-absent-shard": (_indexed(json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}})),
                                 ["its model.safetensors.index.json names model-00002.safetensors, which is not "
                                  "there"]),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_bad_weights_folder_is_one_line_before_any_rank_starts(tmp_path, monkeypatch, case):
    """A folder whose weights do not fit the model (a file cut short, a header that is not one, a tensor of
    another shape, absent or in a dtype that does not cast, an index that is not one) is refused from the files'
    headers while the job validates: one line on the command line, status 2, no rank started, no run folder."""
    import disttrain.rank.run
    from tests.conftest import train_cli_in_process

    change, expected = BAD_FOLDERS[case]
    folder = saved_folder(tmp_path / "hf")
    change(folder)
    started = []
    monkeypatch.setattr(disttrain.rank.run, "run_rank", started.append)
    base = [o for o in hf_overrides("llama", {}) if not o.startswith("model.arch")]
    proc = train_cli_in_process([*base, f"model.path={folder}", "model.pretrained=true", "trainer.devices=1"],
                                tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert lines[0].startswith(f"Error: model.path='{folder}' is invalid: "), lines[0]
    assert all(part in lines[0] for part in expected), lines[0]
    assert not started and [p.name for p in tmp_path.iterdir()] == ["hf"]  # no rank, no run directory


@pytest.mark.parametrize("layout", ["zero3", "tp"])
def test_an_export_after_training_loads_in_transformers_with_the_same_logits(tmp_path, layout):
    """Trained under ZeRO-3 or tensor parallelism, exported with ``--format hf``: ``from_pretrained`` gives the
    logits of the framework's own model loaded from the same checkpoint (fp32)."""
    import transformers
    from omegaconf import OmegaConf

    from disttrain.checkpoint.export import consolidated_weights, export_hf
    from disttrain.launch.job import train
    from disttrain.models import build_model
    from tests.conftest import compose_config

    overrides, ranks = LAYOUTS[layout]
    run_dir = tmp_path / "run"
    train(compose_config([*hf_overrides("qwen3", ARCHS["qwen3"]), *FAMILIES["sgd"], *overrides,
                          f"trainer.devices={ranks}"], run_dir))
    out = export_hf(run_dir, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, attn_implementation="sdpa")
    run = validate(OmegaConf.load(run_dir / "config.yaml"), world_size=ranks)
    ours = build_model(run.model, run.datamodule.spec)
    ours.load_state_dict(consolidated_weights(run_dir / "checkpoints" / "last.ckpt"), strict=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits, ours(tokens), rtol=0, atol=1e-5)

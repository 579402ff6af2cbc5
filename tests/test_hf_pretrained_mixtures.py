"""Hugging Face mixtures of experts started from a folder as ``save_pretrained`` writes it (and the hub holds it):
one tensor per expert (Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3.weight``, Qwen3-MoE's
``mlp.experts.E.gate_proj/up_proj/down_proj.weight``), where the model holds grouped weights
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``). The reader converts them through
``transformers``' own conversion mapping (``disttrain.models.hf.conversion``), each rank reading only what it holds,
under every layout the model runs; a fine-tuned mixture exports to the same layout, which ``from_pretrained`` loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.test_hf_models import LAYOUTS, hf_overrides, starting_losses  # noqa: E402
from tests.test_moe_config import HF_MOE  # noqa: E402

PER_EXPERT = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w3.weight",
              "qwen3_moe": "model.layers.0.mlp.experts.3.up_proj.weight"}
"""A tensor of each family's per-expert layout on disk (the grouped model holds none of that name)."""
MIXTURE_LAYOUTS = {**LAYOUTS, "ep": (["parallel=zero3", "parallel.ep=2"], 2)}
# measured (fp32, gloo): the step-0 validation loss within 1.7e-7 relative of transformers' own loss of the folder
LOSS_RTOL = 1e-6


def saved_mixture(folder: Path, arch: str) -> Path:
    """A seeded random tiny ``arch`` mixture (4 experts, 2 per token) saved with ``save_pretrained``."""
    import transformers

    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model(arch, vocab_size=256, **HF_MOE[arch])
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def weights_of(folder: Path):
    """``folder``'s safetensors weights, refused as ``model.path`` (as ``model.pretrained=true`` reads them)."""
    from disttrain.safetensors_reader import ConfigRefusal, SafetensorsFolder

    return SafetensorsFolder(folder, ConfigRefusal("model.path", str(folder), "a folder of safetensors weights"))


def saved_names(folder: Path) -> set[str]:
    """The tensor names of a folder's ``model.safetensors``."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


@pytest.mark.parametrize(("arch", "layout"), [
    ("mixtral", "single"), ("mixtral", "zero3"), ("mixtral", "tp"), ("mixtral", "ep"), ("mixtral", "pp"),
    ("qwen3_moe", "single"), ("qwen3_moe", "zero3"), ("qwen3_moe", "tp"), ("qwen3_moe", "ep"), ("qwen3_moe", "pp")])
def test_a_saved_mixture_starts_where_transformers_is(tmp_path, arch, layout):
    """Saved per expert, read into the grouped model whole, as ZeRO-3 shards of experts, as whole experts per tp
    or ep rank, or stage by stage: validated before the first step to ``transformers``' own loss of the folder."""
    folder = saved_mixture(tmp_path / "hf", arch)
    assert PER_EXPERT[arch] in saved_names(folder)  # save_pretrained writes one tensor per expert
    overrides = [o for o in hf_overrides(arch, {}) if not o.startswith("model.arch")]
    if layout != "single":
        overrides += [*MIXTURE_LAYOUTS[layout][0], f"trainer.devices={MIXTURE_LAYOUTS[layout][1]}"]
    val_loss, expected = starting_losses(folder, overrides, tmp_path / "run")
    assert val_loss == pytest.approx(expected, rel=LOSS_RTOL)


def test_each_rank_reads_only_the_experts_it_holds(tmp_path, monkeypatch):
    """The grouped weights of the experts one of two ranks holds (its dim-0 half, as ep, tp and ZeRO-3 split them)
    come from those experts' tensors alone, and equal the rows ``transformers`` loads."""
    import transformers

    from disttrain.models.hf import conversion as hf_conversion

    folder = saved_mixture(tmp_path / "hf", "mixtral")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    holder = torch.nn.Module()
    object.__setattr__(holder, "_model", model)
    state = model.state_dict()
    sources = hf_conversion.saved_sources(state, weights_of(folder).headers(), hf_conversion.conversion_of(holder))
    read = []
    monkeypatch.setattr(hf_conversion.Saved, "read", lambda self, box, read_box=hf_conversion.Saved.read: (
        read.append(self.name), read_box(self, box))[1])
    name = "model.layers.1.mlp.experts.gate_up_proj"
    half = sources[name].read(((2, 4), (0, 256), (0, 64)))
    torch.testing.assert_close(half, state[name][2:4], rtol=0, atol=0)
    assert sorted(read) == sorted(f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in (2, 3)
                                  for w in ("w1", "w3"))


def test_a_mixture_with_an_expert_missing_is_one_line(tmp_path, make_config):
    """A folder lacking one expert's tensor is refused while the job validates, naming the grouped weight that
    transformers' conversion cannot fill and its shape."""
    from safetensors.torch import load_file, save_file

    from disttrain.config import validate
    from disttrain.errors import ConfigError

    folder = saved_mixture(tmp_path / "hf", "mixtral")
    tensors = load_file(folder / "model.safetensors")
    tensors.pop("model.layers.1.block_sparse_moe.experts.2.w2.weight")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    base = [o for o in hf_overrides("mixtral", {}) if not o.startswith("model.arch")]
    with pytest.raises(ConfigError, match=r"^model\.path=.* is invalid: a folder of this model's safetensors "
                                          r"weights; the folder's "
                                          r"model\.layers\.1\.block_sparse_moe\.experts\.0\.w2\.weight \(and 2 more\) "
                                          r"give model\.layers\.1\.mlp\.experts\.down_proj as \[3, 64, 128\], where "
                                          r"the model's is \[4, 64, 128\]$"):
        validate(make_config([*base, f"model.path={folder}", "model.pretrained=true"]))


@pytest.mark.parametrize("layout", ["ep"])
def test_a_fine_tuned_mixture_exports_as_save_pretrained_writes_it(tmp_path, layout):
    """Started from a saved Mixtral, fine-tuned under expert parallelism, exported with ``--format hf``: the folder
    holds the tensors ``save_pretrained`` writes (one per expert), and ``from_pretrained`` gives the logits of the
    framework's own model loaded from the run's checkpoint."""
    import transformers
    from omegaconf import OmegaConf

    from disttrain.checkpoint.export import consolidated_weights, export_hf
    from disttrain.config import validate
    from disttrain.launch.job import train
    from disttrain.models import build_model
    from tests.conftest import compose_config
    from tests.test_parity import FAMILIES

    folder = saved_mixture(tmp_path / "hf", "mixtral")
    overrides, ranks = MIXTURE_LAYOUTS[layout]
    base = [o for o in hf_overrides("mixtral", {}) if not o.startswith("model.arch")]
    run_dir = tmp_path / "run"
    train(compose_config([*base, *FAMILIES["sgd"], *overrides, f"trainer.devices={ranks}", f"model.path={folder}",
                          "model.pretrained=true"], run_dir))
    out = export_hf(run_dir, tmp_path / "export")
    assert saved_names(out) == saved_names(folder)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, attn_implementation="sdpa")
    run = validate(OmegaConf.load(run_dir / "config.yaml"), world_size=ranks)
    ours = build_model(run.model, run.datamodule.spec)
    ours.materialize(torch.device("cpu"))
    ours.load_state_dict(consolidated_weights(run_dir / "checkpoints" / "last.ckpt"), strict=True)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens).logits, ours(tokens), rtol=0, atol=1e-5)
    # the fine-tune moved the experts: the export is not the folder it started from
    start = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert not torch.equal(start.model.layers[0].mlp.experts.down_proj, theirs.model.layers[0].mlp.experts.down_proj)


def test_a_converter_with_another_operation_runs_as_transformers_runs_it(tmp_path):
    """A converter whose operations are not only stacks and concatenations (here a transpose) is run by
    ``transformers`` on the whole saved tensor, shaped on meta tensors, and the box is cut from its output."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Transpose, WeightConverter

    from disttrain.models.hf.conversion import Conversion, Converted, saved_sources

    saved = torch.arange(15.0).reshape(3, 5)
    save_file({"layer.w_in.weight": saved}, tmp_path / "model.safetensors")
    conversion = Conversion([WeightConverter("w_in.weight", "w_out.weight", [Transpose(0, 1)])])
    sources = saved_sources(["layer.w_out.weight"], weights_of(tmp_path).headers(), conversion)
    source = sources["layer.w_out.weight"]
    assert isinstance(source, Converted) and source.shape == (5, 3)
    torch.testing.assert_close(source.read(((1, 4), (0, 2))), saved.T[1:4, 0:2], rtol=0, atol=0)


def test_a_folder_of_grouped_experts_is_read_by_its_own_names(tmp_path):
    """A folder holding the grouped weights themselves (as ``from_pretrained`` also reads) gives each by its name."""
    import transformers
    from safetensors.torch import save_file

    from disttrain.models.hf.conversion import Saved, conversion_of, saved_sources

    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen3_moe", vocab_size=256, **HF_MOE["qwen3_moe"]))
    state = model.state_dict()
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, tmp_path / "model.safetensors")
    holder = torch.nn.Module()
    object.__setattr__(holder, "_model", model)
    sources = saved_sources(state, weights_of(tmp_path).headers(), conversion_of(holder))
    assert set(sources) == set(state) and all(isinstance(s, Saved) and s.name == n for n, s in sources.items())

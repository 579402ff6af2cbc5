"""The Hugging Face export as a drop-in folder: a model fine-tuned from a folder's weights on text of that folder's
tokenizer, under ZeRO-3, exports to a folder that ``from_pretrained`` loads with its KV cache on, its generation
config and the run's tokenizer, whose ``generate()`` writes what ``disttrain.generate`` writes, in files of ordinary
modes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from disttrain.errors import ConfigError  # noqa: E402
from tests.test_hf_models import ARCHS  # noqa: E402
from tests.test_text_data import EOS, make_tokenizer, write_corpus  # noqa: E402

PROMPT = "The with statement is used to"
NEW_TOKENS = 12


def llama_folder(folder: Path, max_length: int) -> Path:
    """A Llama folder of seeded weights (larger than transformers' init, so that each next token depends on the whole
    context) with its own ``tokenizer.json`` and a ``tokenizer_config.json`` naming its end-of-text token."""
    import transformers
    from tokenizers import Tokenizer

    make_tokenizer(folder)
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(EOS)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "model_max_length": max_length}))
    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model("llama", vocab_size=300, eos_token_id=eos, bos_token_id=None,
                                               **ARCHS["llama"])
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(mean=1.0 if param.ndim == 1 else 0.0, std=0.1)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> tuple[Path, Path]:
    """A Llama folder (seeded weights, its own ``tokenizer.json`` and ``tokenizer_config.json``) fine-tuned for
    three steps under ZeRO-3 on two ranks on text of its tokenizer: the folder and the run directory."""

    from disttrain.launch.job import train
    from tests.conftest import compose_config

    root = tmp_path_factory.mktemp("fine-tune")
    folder = llama_folder(root / "llama", max_length=32)
    files, _ = write_corpus(root / "corpus")
    run_dir = root / "run"
    train(compose_config(["model=hf", f"model.path={folder}", "model.pretrained=true", "data=text",
                          f"data.files=[{','.join(map(str, files))}]", f"data.tokenizer={folder}",
                          "data.block_size=32", "batch.global_size=8", "trainer.max_steps=3",
                          "trainer.limit_val_batches=1", "trainer.run_test=false", "logger=csv", "callbacks=none",
                          "optim.lr=1e-3", "parallel=zero3", "trainer.devices=2"], run_dir))
    return folder, run_dir


def test_the_export_generates_with_its_cache_as_disttrain_generate_does(fine_tuned, tmp_path):
    import transformers

    from disttrain.checkpoint.export import export_hf
    from disttrain.generate.loading import load_run
    from disttrain.generate.sampling import sample

    folder, run_dir = fine_tuned
    out = export_hf(run_dir, tmp_path / "hf")
    names = sorted(path.name for path in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    mask = os.umask(0o022)
    os.umask(mask)
    assert {name: stat.S_IMODE((out / name).stat().st_mode) for name in names} == dict.fromkeys(names,
                                                                                               0o666 & ~mask)
    assert json.loads((out / "config.json").read_text())["use_cache"] is True

    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert model.config.use_cache and model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids(EOS)
    loaded = load_run(run_dir, "last")
    prompt = loaded.codec.encode(PROMPT)
    assert tokenizer(PROMPT, add_special_tokens=False)["input_ids"] == prompt
    assert len(prompt) + NEW_TOKENS <= loaded.spec.block_size  # disttrain.generate crops no context here

    inputs = torch.tensor([prompt])
    with torch.no_grad():
        cached, uncached = (model.generate(inputs, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=use_cache,
                                           output_scores=True, return_dict_in_generate=True)
                            for use_cache in (True, False))
    assert cached.past_key_values is not None and uncached.past_key_values is None  # the cache was used
    for with_cache, without in zip(cached.scores, uncached.scores, strict=True):
        torch.testing.assert_close(with_cache, without, rtol=0, atol=1e-5)
    cached = cached.sequences[0].tolist()
    assert cached == uncached.sequences[0].tolist()
    ours = sample(loaded.model, prompt, NEW_TOKENS, loaded.spec.block_size, temperature=0,
                  vocab_size=loaded.spec.vocab_size)
    # generate() stops at the end-of-text token, which disttrain.generate writes on past
    assert len(cached) > len(prompt) and ours[:len(cached)] == cached, (cached, ours)


def test_a_tokenizer_folder_that_is_not_one_is_refused_in_one_line(fine_tuned, tmp_path):
    """The run's tokenizer folder is read as the run reads it: a file of it that is not what its name says stops
    the export with one line naming ``data.tokenizer``, and writes nothing."""
    from omegaconf import OmegaConf

    from disttrain.checkpoint.export import export_hf

    folder, run_dir = fine_tuned
    broken = tmp_path / "tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (broken / "special_tokens_map.json").write_text("{not json")
    copy = tmp_path / "run"
    (copy / "checkpoints").mkdir(parents=True)
    (copy / "checkpoints" / "last.ckpt").symlink_to(run_dir / "checkpoints" / "last.ckpt")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    cfg.data.tokenizer = str(broken)
    (copy / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    with pytest.raises(ConfigError) as refused:
        export_hf(copy, tmp_path / "hf")
    message = str(refused.value)
    assert message.startswith(f"data.tokenizer='{broken}' is invalid: a tokenizer folder whose "
                              "special_tokens_map.json is JSON") and "\n" not in message, message
    assert not (tmp_path / "hf").exists()

"""The fine-tune path of a Hugging Face model, end to end as the README shows it, each step as a user runs it:
a pretrained folder with its tokenizer, fine-tuned under ZeRO-3 on the reader's own text, exported with
``--format hf``, read back by ``from_pretrained`` (model and tokenizer) and continued by ``generate()`` with its
KV cache, and continued by ``python -m disttrain.generate`` from the run itself: the two greedy continuations are
the same text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.conftest import ROOT, train_cli  # noqa: E402
from tests.test_cli import with_own_files  # noqa: E402

PROMPT = "The import statement"
NEW_TOKENS = 12


def module_cli(module: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m module *args`` in ``cwd`` as a user runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_pretrained_folder_to_fine_tune_to_export_to_generate(tmp_path):
    import torch
    import transformers

    model_dir, notes = with_own_files(["DIR", "notes.txt"], tmp_path)
    proc = train_cli(["model=hf", f"model.path={model_dir}", "model.pretrained=true", "data=text",
                      f"data.files=[{notes}]", f"data.tokenizer={model_dir}", "data.block_size=64", "parallel=zero3",
                      "trainer.devices=2", "trainer.validate_before_training=true", "trainer.max_steps=3",
                      "trainer.limit_val_batches=1", "trainer.limit_test_batches=1", "batch.global_size=8",
                      "hydra.run.dir=run"], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "validation before training, at step 0" in proc.stdout
    run_dir = tmp_path / "run"

    proc = module_cli("disttrain.checkpoint.export", [str(run_dir), "--format", "hf", "tuned"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = tmp_path / "tuned"
    assert json.loads((exported / "config.json").read_text()).get("use_cache", True) is True

    tokenizer = transformers.AutoTokenizer.from_pretrained(exported, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    assert cached.size(1) == prompt.size(1) + NEW_TOKENS

    proc = module_cli("disttrain.generate", [str(run_dir), "--prompt", PROMPT, "--temperature", "0",
                                             "--max-new-tokens", str(NEW_TOKENS)], tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.rstrip("\n") == tokenizer.decode(cached[0])

"""``benchmarks/plan_at_scale.py``: every published row is laid out on the GPUs its publication names, and a row
prints one predicted tokens/s per GPU and memory per GPU beside the published figures, with their ratios."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest


def _benchmark():
    # loaded by path: "benchmarks" is also the name of a package some dependencies install
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "plan_at_scale.py"
    spec = importlib.util.spec_from_file_location("plan_at_scale_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ROW = re.compile(r"^\| (?P<key>[\w.-]+) \|.*\| (?P<predicted>[\d,]+) \| (?P<published>[\d,]+) \| "
                 r"\*\*(?P<ratio>[\d.]+)x\*\* \|")
"""A table row: its key, predicted and published tokens/s per GPU and their ratio."""


def _rows(text: str) -> dict[str, re.Match]:
    return {m["key"]: m for m in map(ROW.match, text.splitlines()) if m}


def test_published_rows_are_laid_out_on_their_gpus():
    bench = _benchmark()
    assert len(bench.ROWS) == len(bench.PUBLISHED_RUNS)  # keys are unique
    for run in bench.PUBLISHED_RUNS:
        assert run.layout.world_size == run.gpus, run.key
        assert run.tokens_per_s > 0 and run.model in bench.MODELS_PUBLISHED, run.key
        assert set(run.reasons) <= set(bench.REASONS), run.key
    # Megatron's FLOPs per token reduce to 6 x (weights that multiply) + 12 L h s for a GPT without grouped
    # queries or SwiGLU: its tokens/s are its per-GPU teraFLOP/s by the usual count
    layers, width, sequence, vocab = 24, 2048, 4096, 131072
    usual = 6 * (12 * layers * width**2 + vocab * width) + 12 * layers * width * sequence
    assert bench.megatron_flops_per_token("gpt-1.7b", sequence) == pytest.approx(usual)
    assert bench.ROWS["mlm-1.7b"].tokens_per_s == pytest.approx(408.8e12 / usual)

def test_a_row_prints_its_ratio_to_the_published_figure(capsys):
    bench = _benchmark()
    bench.main(["--rows", "h200-gpt2-compile"])
    out = capsys.readouterr().out
    row = _rows(out)["h200-gpt2-compile"]
    predicted, published = (float(row[k].replace(",", "")) for k in ("predicted", "published"))
    assert published == 429581
    assert float(row["ratio"]) == pytest.approx(predicted / published, abs=0.006)
    assert "8.45 GB" in row.string  # the published memory beside the predicted
    assert "of 1 rows within 10%" in out


def test_an_unknown_row_is_refused(capsys):
    bench = _benchmark()
    with pytest.raises(SystemExit):
        bench.main(["--rows", "tt-8b-fsdp", "llama-9000"])
    assert "--rows: unknown row llama-9000" in capsys.readouterr().err


@pytest.mark.slow
def test_every_published_row_prints_a_ratio(capsys):
    bench = _benchmark()
    bench.main([])
    assert set(_rows(capsys.readouterr().out)) == set(bench.ROWS)

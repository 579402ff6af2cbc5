"""``data=mixture``'s validation reports a loss per source beside the overall one, on one rank as on two."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from disttrain.config import validate
from disttrain.data import MixtureConfig, MixtureSource, build_datamodule
from disttrain.errors import ConfigError
from disttrain.launch.job import train
from tests.conftest import compose_config, logged_metric
from tests.test_run import GPT_FAST
from tests.test_text_data import make_tokenizer

STEPS = 8
RUN = [*(option for option in GPT_FAST if not option.startswith(("data=", "trainer.limit_val_batches"))),
       "model.dropout=0.0", f"trainer.max_steps={STEPS}", "data.block_size=32", "data.val_documents=5",
       f"data.samples_per_epoch={STEPS * 8}"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two sources that a model learns at different rates: one sentence over and over, and random letters."""
    folder = tmp_path_factory.mktemp("val_sources")
    letters = random.Random(0)
    documents = {"repeated": ["the cat sat on the mat and the dog sat on the log. " * 6] * 30,
                 "noise": [" ".join("".join(letters.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(5))
                                    for _ in range(50)) for _ in range(30)]}
    paths = {}
    for kind, texts in documents.items():
        paths[kind] = folder / f"{kind}.jsonl"
        paths[kind].write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return {**paths, "tokenizer": make_tokenizer(folder / "tok")}


def mixture_options(sources: dict[str, Path]) -> list[str]:
    """The two sources, the first named ``repeat``, the second by its file (``noise``)."""
    listed = f"[{{path: {sources['repeated']}, name: repeat}}, {{path: {sources['noise']}}}]"
    return ["data=mixture", f"data.sources={listed}", f"data.tokenizer={sources['tokenizer']}"]


def direct_losses(run_dir: Path, step: int) -> tuple[dict[str, float], float]:
    """Each source's loss and the overall loss of the run's weights at ``step`` on every validation window,
    computed in this process from each source's held-out windows (the mean over all their targets)."""
    from disttrain.checkpoint.export import export
    from disttrain.checkpoint.io import load_weights_file
    from disttrain.models import build_model

    cfg = OmegaConf.load(run_dir / "config.yaml")
    run = validate(cfg, world_size=cfg.trainer.devices)
    data = build_datamodule(run.data, run.batch.micro_size, run.train.seed)
    model = build_model(run.model, data.spec)
    weights = export(run_dir / "checkpoints" / f"step{step}.ckpt", run_dir / "model.pt")
    model.load_state_dict(load_weights_file(weights), strict=True)
    model.eval()
    sums, counts = {}, {}
    with torch.no_grad():
        for name, windows in zip(data.spec.eval_sources, data.datasets["val"].datasets, strict=True):
            inputs, targets = (torch.stack(part) for part in zip(*(windows[i] for i in range(len(windows))),
                                                                 strict=True))
            logits = model(inputs)
            sums[name] = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                                         reduction="sum").double().item()
            counts[name] = targets.numel()
    return {name: sums[name] / counts[name] for name in sums}, sum(sums.values()) / sum(counts.values())


LAYOUTS = {"one": [], "ddp2": ["parallel=ddp", "trainer.devices=2"], "cp2": ["trainer.devices=2", "parallel.cp=2"],
           "pp2": ["trainer.devices=2", "parallel=pipeline", "model.tie_weights=false"]}


@pytest.mark.parametrize("ranks", LAYOUTS)
def test_each_source_has_its_own_validation_loss(tmp_path, sources, ranks):
    """``val/loss/<source>`` is the loss of the trained weights on that source's held-out windows, computed
    directly; ``val/loss`` stays the mean over every validation target; results.json carries both. On one rank,
    two data-parallel ranks (the second's last batch padded), two context-parallel ranks (each window's
    sources split with its targets) and a two-stage pipeline (the last stage's logits of the whole batch; the
    first stage adds nothing and joins the sum over the ranks)."""
    parallel = LAYOUTS[ranks]
    train(compose_config([*RUN, *mixture_options(sources), *parallel], tmp_path))
    direct, overall = direct_losses(tmp_path, STEPS)
    logged = {name: logged_metric(tmp_path, f"val/loss/{name}") for name in ("repeat", "noise")}
    assert [step for step, _ in logged["repeat"]] == [step for step, _ in logged["noise"]] == [STEPS]
    for name, rows in logged.items():
        assert rows[0][1] == pytest.approx(direct[name], rel=1e-6, abs=1e-6), name
    (_, logged_overall), = logged_metric(tmp_path, "val/loss")
    assert logged_overall == pytest.approx(overall, rel=1e-6, abs=1e-6)
    assert abs(direct["repeat"] - direct["noise"]) > 1e-2  # the sources differ: a mix of them would blur the two
    metrics = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert {key for key in metrics if key.startswith("val/loss")} == {"val/loss", "val/loss/repeat", "val/loss/noise"}
    print(f"ranks {ranks}: logged per source {[rows[0][1] for rows in logged.values()]}, direct {direct}; "
          f"differences {[abs(rows[0][1] - direct[name]) for name, rows in logged.items()]}, "
          f"overall {abs(logged_overall - overall):.2e}")


def test_source_names_are_unique_parts_of_a_metric_key(sources):
    """A source's name defaults to its file's stem (a glob's folder); a clash or a character outside a key's is one
    ConfigError naming the source's key."""
    def config(*listed: MixtureSource) -> MixtureConfig:
        return MixtureConfig(sources=list(listed), tokenizer=str(sources["tokenizer"]))

    noise, repeated = str(sources["noise"]), str(sources["repeated"])
    assert config(MixtureSource(repeated), MixtureSource(noise)).source_names() == ("repeated", "noise")
    glob = str(Path(noise).parent / "*.jsonl")
    assert config(MixtureSource(glob)).source_names() == (Path(noise).parent.name,)
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.name='noise' is invalid: a name no other source has"):
        config(MixtureSource(noise), MixtureSource(repeated, name="noise")).validate()
    with pytest.raises(ConfigError, match=r"data\.sources\[0\]\.name='web/code' is invalid: letters, digits"):
        config(MixtureSource(noise, name="web/code")).validate()


def test_a_source_the_validation_does_not_reach_logs_no_loss(tmp_path, sources):
    """``trainer.limit_val_batches`` stopping inside the first source's windows: ``val/loss/repeat`` is logged and
    the unreached ``noise`` has no key at all (not a nan)."""
    train(compose_config([*RUN, *mixture_options(sources), "trainer.limit_val_batches=1"], tmp_path))
    metrics = json.loads((tmp_path / "results.json").read_text())["metrics"]
    assert {key for key in metrics if key.startswith("val/loss")} == {"val/loss", "val/loss/repeat"}, metrics
    assert metrics["val/loss/repeat"] == pytest.approx(metrics["val/loss"])

"""``data=mixture``: sources mixed by weight in one global stream, packed windows, exact resume, what was read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from disttrain.config import validate
from disttrain.data import MixtureConfig, MixtureSource, build_datamodule
from disttrain.data.mixture_stream import MixtureStream, MixtureWindows, RankShare, StreamState
from disttrain.errors import ConfigError
from disttrain.launch.job import train
from disttrain.report.console import run_summary
from tests.conftest import compose_config
from tests.mixture_corpus import source_texts, write_sources
from tests.test_run import GPT_FAST, step_losses
from tests.test_text_data import make_tokenizer

BLOCK = 32
KINDS = ("parquet", "jsonl", "saved")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """The three sources and a tokenizer, written once for the module."""
    folder = tmp_path_factory.mktemp("mixture")
    return {**write_sources(folder / "sources"), "tokenizer": make_tokenizer(folder / "tok")}


def mixture_config(corpus: dict[str, Path], **options) -> MixtureConfig:
    """The typed ``data=mixture`` config of the three sources, weights 3, 2, 1."""
    sources = [MixtureSource(str(corpus["parquet"]), 3.0), MixtureSource(str(corpus["jsonl"]), 2.0, "content"),
               MixtureSource(str(corpus["saved"]), 1.0)]
    return MixtureConfig(sources=options.pop("sources", sources), tokenizer=str(corpus["tokenizer"]),
                         block_size=BLOCK, val_documents=4, **options)


def read_windows(stream: MixtureStream, count: int) -> list[tuple[np.ndarray, list]]:
    """The next ``count`` windows of ``stream``: tokens and pieces."""
    return [stream.next_window() for _ in range(count)]  # type: ignore[misc]


def test_windows_pack_the_drawn_documents_each_closed_by_the_end_token(corpus):
    """Draw ``k`` reads the next document of the source ``source_of`` picks; the stream is those documents'
    tokens, each followed by the end-of-document id, cut into windows of ``T`` inputs plus one target; a window's
    pieces name exactly the documents (and their token ranges) its inputs hold, and the wrapped source counts
    its passes."""
    from tokenizers import Tokenizer

    data = build_datamodule(mixture_config(corpus), micro_batch_size=4, seed=3)
    plan, eos = data.plan, data.spec.document_end
    assert eos == plan.eos_id and data.spec.block_size == BLOCK
    tokenizer = Tokenizer.from_file(str(corpus["tokenizer"] / "tokenizer.json"))
    texts = source_texts()
    windows = read_windows(MixtureStream(plan, StreamState.start(3)), 400)

    sources = plan.source_of(0, np.arange(1000)).tolist()
    cursors, expected, drawn = [0, 0, 0], [], []
    for source in sources:
        index = cursors[source] % plan.train_documents[source]
        ids = tokenizer.encode(texts[KINDS[source]][index], add_special_tokens=False).ids
        expected += [*ids, eos]
        drawn.append((source, index, cursors[source] // plan.train_documents[source], len(ids) + 1))
        cursors[source] += 1
    assert len(expected) > 400 * BLOCK
    for number, (tokens, _) in enumerate(windows):
        assert tokens.tolist() == expected[number * BLOCK:number * BLOCK + BLOCK + 1]

    pieces = [piece for _, window in windows for piece in window]
    rebuilt = [(source, document, passes) for source, document, passes, first, last in pieces if first == 0]
    assert rebuilt == [entry[:3] for entry in drawn[:len(rebuilt)]]
    for (source, document, passes, _, last), following in zip(pieces, pieces[1:], strict=False):
        length = next(entry[3] for entry in drawn if entry[:3] == (source, document, passes))
        if following[3] != 0:  # the same document goes on in the next window
            assert following[:3] == (source, document, passes) and following[3] == last
        else:
            assert last == length
    assert max(passes for _, _, passes, _, _ in pieces) >= 1  # a source has wrapped


def batches_of(plan, share_options: dict, workers: int, start: StreamState | None = None) -> list[dict]:
    """Every micro-batch one rank reads in an epoch, through a DataLoader with ``workers`` workers."""
    share = RankShare(**share_options)
    windows = MixtureWindows(plan, start or StreamState.start(3), share)
    loader = DataLoader(windows, batch_size=None, num_workers=workers) if workers else windows
    return [{"inputs": inputs, "targets": targets, **read} for inputs, targets, read in loader]


def global_windows(batches_by_rank: list[list[dict]], micro: int) -> dict[int, tuple]:
    """Each global window's inputs and pieces, from the micro-batches of every rank (rank r's sample t of
    micro-batch i is global window (i * ranks + r) * micro + t)."""
    ranks, found = len(batches_by_rank), {}
    for rank, batches in enumerate(batches_by_rank):
        for batch in batches:
            for sample in range(micro):
                window = (batch["batch"] * ranks + rank) * micro + sample
                found[window] = (batch["inputs"][sample].tolist(), batch["pieces"][sample])
    return found


def test_every_rank_worker_and_micro_batch_count_reads_one_global_order(corpus):
    """One rank with micro-batch 8 and no worker, and three ranks with micro-batch 2 and two workers each, read
    the same global windows; every rank's state after a micro-batch is the same state, and a stream started from
    it reads on exactly where the one rank did."""
    plan = build_datamodule(mixture_config(corpus), micro_batch_size=1, seed=5).plan
    one = batches_of(plan, {"micro_size": 8, "accumulation": 1, "replicas": 1, "rank": 0, "first_batch": 0,
                            "batches": 6}, workers=0)
    three = [batches_of(plan, {"micro_size": 2, "accumulation": 2, "replicas": 3, "rank": rank, "first_batch": 0,
                               "batches": 8}, workers=2) for rank in range(3)]
    reference, split = global_windows([one], 8), global_windows(three, 2)
    assert len(split) == 48 and all(split[window] == reference[window] for window in split)
    assert [batch["batch"] for batch in three[1]] == list(range(8))
    for step in range(8):
        assert three[0][step]["state"] == three[1][step]["state"] == three[2][step]["state"]
    assert three[0][3]["state"] == one[2]["state"]  # both at global window 24
    resumed = batches_of(plan, {"micro_size": 8, "accumulation": 1, "replicas": 1, "rank": 0, "first_batch": 3,
                                "batches": 6}, workers=0, start=StreamState.from_dict(three[0][3]["state"]))
    assert [batch["inputs"].tolist() for batch in resumed] == [batch["inputs"].tolist() for batch in one[3:]]
    assert resumed[-1]["state"] == one[-1]["state"]


def test_an_epoch_ends_with_the_first_source_that_runs_out(corpus):
    """``data.on_exhausted=end_epoch``: the stream ends at the draw that finds its source empty, and only whole
    optimiser steps of it are read."""
    config = mixture_config(corpus, on_exhausted="end_epoch")
    plan = build_datamodule(config, micro_batch_size=1, seed=1).plan
    stream = MixtureStream(plan, StreamState.start(3))
    windows = []
    while (window := stream.next_window()) is not None:
        windows.append(window)
    from tokenizers import Tokenizer

    tokenizer, texts = Tokenizer.from_file(str(corpus["tokenizer"] / "tokenizer.json")), source_texts()
    sources, cursors, tokens = plan.source_of(0, np.arange(1000)).tolist(), [0, 0, 0], 0
    for source in sources:  # the draws up to the first that finds its source empty
        if cursors[source] == plan.train_documents[source]:
            break
        tokens += len(tokenizer.encode(texts[KINDS[source]][cursors[source]], add_special_tokens=False).ids) + 1
        cursors[source] += 1
    assert 0 < tokens - len(windows) * BLOCK <= BLOCK  # all but a tail too short for a window and its target
    read = {(source, index) for _, pieces in windows for source, index, _, _, _ in pieces}
    drawn = {(source, index) for source in range(3) for index in range(cursors[source])}
    assert read <= drawn and len(drawn - read) <= 1  # the last document may lie wholly in the tail
    assert all(passes == 0 for _, pieces in windows for _, _, passes, _, _ in pieces)
    batches = batches_of(plan, {"micro_size": 4, "accumulation": 2, "replicas": 1, "rank": 0, "first_batch": 0,
                                "batches": 10_000}, workers=0)
    assert len(batches) == len(windows) // 8 * 2 and len(batches) % 2 == 0


def test_validation_reads_each_sources_held_out_documents(corpus):
    """Validation holds each source's last ``val_documents`` documents, packed source by source."""
    from tokenizers import Tokenizer

    data = build_datamodule(mixture_config(corpus), micro_batch_size=2, seed=0)
    tokenizer = Tokenizer.from_file(str(corpus["tokenizer"] / "tokenizer.json"))
    val, texts = data.datasets["val"], source_texts()
    assert len(val.datasets) == 3
    for kind, windows in zip(KINDS, val.datasets, strict=True):
        held = [token for text in texts[kind][-4:] for token in
                (*tokenizer.encode(text, add_special_tokens=False).ids, data.plan.eos_id)]
        assert len(windows) == (len(held) - 1) // BLOCK
        inputs, targets = windows[len(windows) - 1]
        assert inputs.tolist() == held[(len(windows) - 1) * BLOCK:len(windows) * BLOCK]


def _missing(tmp_path, corpus):
    return {"sources": [MixtureSource(str(tmp_path / "nope.parquet"))]}, "data.sources[0].path", "nope.parquet"


def _empty(tmp_path, corpus):
    (tmp_path / "empty.jsonl").write_text("\n")
    return {"sources": [MixtureSource(str(tmp_path / "empty.jsonl"))]}, "data.sources[0].path", "empty.jsonl"


def _no_column(tmp_path, corpus):
    return ({"sources": [MixtureSource(str(corpus["parquet"]), field="body")]}, "data.sources[0].field",
            "web.parquet")


def _no_key(tmp_path, corpus):
    return {"sources": [MixtureSource(str(corpus["jsonl"]))]}, "data.sources[0].field", "code.jsonl"


def _negative(tmp_path, corpus):
    return ({"sources": [MixtureSource(str(corpus["parquet"]), -1.0)]}, "data.sources[0].weight", "-1")


def _all_zero(tmp_path, corpus):
    return ({"sources": [MixtureSource(str(corpus["parquet"]), 0.0), MixtureSource(str(corpus["saved"]), 0.0)]},
            "data.sources", "at least one")


def _corrupt(tmp_path, corpus):
    good = Path(corpus["parquet"]).read_bytes()
    (tmp_path / "torn.parquet").write_bytes(good[: len(good) // 2] + b"\0" * 64)
    return {"sources": [MixtureSource(str(tmp_path / "torn.parquet"))]}, "data.sources[0].path", "torn.parquet"


def _corrupt_page(tmp_path, corpus):
    """A Parquet file whose footer reads but whose second row group's text pages do not decode."""
    import pyarrow.parquet as pq

    data = bytearray(Path(corpus["parquet"]).read_bytes())
    chunk = pq.ParquetFile(corpus["parquet"]).metadata.row_group(1).column(1)
    middle = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size // 2
    data[middle:middle + 8] = bytes(byte ^ 0xFF for byte in data[middle:middle + 8])
    (tmp_path / "paged.parquet").write_bytes(bytes(data))
    assert pq.ParquetFile(tmp_path / "paged.parquet").metadata.num_rows == 40
    return {"sources": [MixtureSource(str(tmp_path / "paged.parquet"))]}, "data.sources[0].path", "paged.parquet"


def _broken_line(tmp_path, corpus):
    """A JSON-lines file whose fifth line is cut short."""
    lines = Path(corpus["jsonl"]).read_text().splitlines()
    lines[4] = lines[4][: len(lines[4]) // 2]
    (tmp_path / "cut.jsonl").write_text("\n".join(lines) + "\n")
    return ({"sources": [MixtureSource(str(tmp_path / "cut.jsonl"), field="content")]}, "data.sources[0].path",
            "cut.jsonl")


def _too_few(tmp_path, corpus):
    (tmp_path / "one.txt").write_text("a single document")
    return {"sources": [MixtureSource(str(tmp_path / "one.txt"))]}, "data.sources[0].path", "one.txt"


BAD_INPUT = {"missing file": _missing, "empty source": _empty, "parquet column that does not exist": _no_column,
             "jsonl key that does not exist": _no_key, "negative weight": _negative, "all weights zero": _all_zero,
             "corrupt parquet": _corrupt, "parquet page that does not decode": _corrupt_page,
             "jsonl line broken after the first": _broken_line, "fewer documents than held out": _too_few}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_config_error_naming_the_key_and_the_file(tmp_path, corpus, case):
    options, key, named = BAD_INPUT[case](tmp_path, corpus)
    with pytest.raises(ConfigError) as err:
        mixture_config(corpus, **options).validate()
    assert err.value.key == key and named in str(err.value) and "\n" not in str(err.value), err.value


STEPS, SAVED = 8, 4
RUN = [*(option for option in GPT_FAST if not option.startswith("data=")), "model.dropout=0.0",
       "data.block_size=32", "data.val_documents=4", "data.samples_per_epoch=256", "trainer.limit_val_batches=1"]


def mixture_options(corpus: dict[str, Path], log: Path) -> list[str]:
    """Overrides of a run on the three sources, logging what each rank reads into ``log``."""
    sources = (f"[{{path: {corpus['parquet']}, weight: 3}}, {{path: {corpus['jsonl']}, weight: 2, field: content}}, "
               f"{{path: {corpus['saved']}, weight: 1}}]")
    return ["data=mixture", f"data.sources={sources}", f"data.tokenizer={corpus['tokenizer']}", f"data.read_log={log}"]


def logged_windows(log: Path, micro: int, ranks: int) -> dict[int, list]:
    """Each global window's documents from the read logs of ``ranks`` data-parallel ranks (files by rank; a
    micro-batch's index counts from the start of the epoch, also in a resumed run)."""
    found: dict[int, list] = {}
    for rank in range(ranks):
        for line in (log / f"rank{rank}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            for sample, pieces in enumerate(entry["windows"]):
                window = (entry["batch"] * ranks + rank) * micro + sample
                assert window not in found
                found[window] = pieces
    return found


def test_a_mixture_resumed_on_other_ranks_and_workers_reads_what_it_had_not(tmp_path, corpus):
    """One uninterrupted run (one rank, no worker) against a run on two data-parallel ranks with one worker each,
    stopped at step 4 and resumed under context parallelism 2 (one data-parallel rank) with two workers: by the
    read logs, the two runs together read the uninterrupted run's windows, each once, document by document; the
    losses continue the uninterrupted curve; ``results.json`` counts what was read per source."""
    whole, saved, resumed = tmp_path / "whole", tmp_path / "saved", tmp_path / "resumed"
    train(compose_config([*RUN, *mixture_options(corpus, whole / "log"), f"trainer.max_steps={STEPS}"], whole))
    # the saving run's schedule is the whole run's: it goes on to the end, and its save point of step 4 resumes
    train(compose_config([*RUN, *mixture_options(corpus, saved / "log"), f"trainer.max_steps={STEPS}",
                          f"checkpoint.every_n_train_steps={SAVED}", "checkpoint.keep_last=2", "trainer.devices=2",
                          "parallel=ddp", "data.num_workers=1"], saved))
    point = saved / "checkpoints" / f"last-step{SAVED}.ckpt"
    train(compose_config([*RUN, *mixture_options(corpus, resumed / "log"), f"trainer.max_steps={STEPS}",
                          "trainer.devices=2", "parallel.cp=2", "data.num_workers=2", f"resume={point}"], resumed))

    reference = logged_windows(whole / "log", 8, 1)
    first = {window: pieces for window, pieces in logged_windows(saved / "log", 4, 2).items() if window < SAVED * 8}
    second = logged_windows(resumed / "log", 8, 1)
    assert (resumed / "log" / "rank1.jsonl").read_text() == (resumed / "log" / "rank0.jsonl").read_text()
    assert sorted(reference) == list(range(STEPS * 8))
    assert sorted(first) == list(range(SAVED * 8)) and sorted(second) == list(range(SAVED * 8, STEPS * 8))
    assert [{**first, **second}[window] for window in range(STEPS * 8)] == [reference[w] for w in range(STEPS * 8)]

    curve, before, after = step_losses(whole), step_losses(saved)[:SAVED], step_losses(resumed)[-(STEPS - SAVED):]
    deviation = max(abs(a - b) / abs(a) for a, b in zip(curve, [*before, *after], strict=True))
    assert deviation <= 1e-5, (deviation, curve, before, after)

    read = json.loads((resumed / "results.json").read_text())["data"]
    tokens = [sum(last - first for source_, _, _, first, last in pieces if source_ == source)
              for source in range(3) for pieces in [[piece for window in reference.values() for piece in window]]]
    assert [source["tokens"] for source in read["sources"]] == tokens and read["tokens"] == STEPS * 8 * BLOCK
    assert json.loads((whole / "results.json").read_text())["data"] == read
    summary = run_summary(json.loads((resumed / "results.json").read_text()), resumed / "results.json")
    assert "read 2,048 tokens" in summary and f"web.parquet {read['sources'][0]['document_share']:.1%}" in summary
    print(f"mixture resume: loss deviation {deviation:.2e}; shares",
          [(source["weight_share"], source["document_share"]) for source in read["sources"]])


def test_a_mixture_config_composes_and_validates(tmp_path, corpus):
    run = validate(compose_config([*RUN, *mixture_options(corpus, tmp_path / "log")], tmp_path / "run"))
    assert run.datamodule.spec.document_end == run.datamodule.plan.eos_id
    run = validate(compose_config([*RUN, *mixture_options(corpus, tmp_path / "log"), "data.document_mask=false"],
                                  tmp_path / "run2"))
    assert run.datamodule.spec.document_end is None
    assert torch.is_tensor(run.datamodule.datasets["val"][0][0])


def test_the_mixture_recipe_states_what_it_reproduces(tmp_path, monkeypatch, make_config):
    """``recipe=gpt_pydocs_mixture`` reads the sources ``python -m disttrain.data.pydocs_sources`` writes where it
    runs: three sources of Python's documentation, composed and validated as the job does."""
    from disttrain.data.pydocs_sources import DEFAULT_FOLDER, write_pydocs_sources

    monkeypatch.chdir(tmp_path)
    write_pydocs_sources(DEFAULT_FOLDER)
    run = validate(make_config(["recipe=gpt_pydocs_mixture"]))
    assert run.train.recipe_name == "gpt_pydocs_mixture"
    assert run.train.expect.command.endswith("recipe=gpt_pydocs_mixture") and run.train.expect.hardware
    assert [source.weight for source in run.data.sources] == [2, 1, 1]
    assert [count > 4 for count in run.datamodule.plan.train_documents] == [True, True, True]


def epoch_pieces(data, epoch: int, log: Path) -> list[list]:
    """The pieces of every window the data module's training loader gives in ``epoch`` (one rank, no trainer:
    every batch counts as trained), from its read log."""
    loader = data.train_dataloader()
    loader.set_epoch(epoch)
    assert all(inputs.shape == (data.micro_batch_size, BLOCK) for inputs, _ in loader)
    data.teardown("fit")  # no trainer: nothing is written here
    data._flush(None)
    entries = [json.loads(line) for line in (log / "rank0.jsonl").read_text().splitlines()]
    return [window for entry in entries if entry["epoch"] == epoch for window in entry["windows"]]


@pytest.mark.parametrize("on_exhausted", ["wrap", "end_epoch"])
def test_the_next_epoch_goes_on_with_the_stream_or_starts_it_again(tmp_path, corpus, on_exhausted):
    """Wrapping sources: epoch 1 reads on where epoch 0 stopped (one stream across epochs). An epoch that ends with a
    source: epoch 1 starts every source again, with draws of its own."""
    config = mixture_config(corpus, on_exhausted=on_exhausted, samples_per_epoch=64, read_log=str(tmp_path / "log"))
    data = build_datamodule(config, micro_batch_size=4, seed=2)
    first, second = epoch_pieces(data, 0, tmp_path / "log"), epoch_pieces(data, 1, tmp_path / "log")
    assert len(first) == len(second) == 64
    stream = MixtureStream(data.plan, StreamState.start(3))
    whole = [[list(piece) for piece in pieces] for _, pieces in read_windows(stream, 128)]
    if on_exhausted == "wrap":
        assert first + second == whole
    else:
        again = MixtureStream(data.plan, StreamState.start(3, epoch=1))
        restarted = [[list(piece) for piece in pieces] for _, pieces in read_windows(again, 64)]
        assert first == whole[:64] and second == restarted and second != whole[64:]
        assert second[0][0][1] == 0 and second[0][0][3] == 0  # a source's first document, from its first token

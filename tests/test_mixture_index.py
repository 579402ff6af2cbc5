"""The mixture's length index: built once before ranks start, rebuilt when a source changes, read instead of the
files by every later process; a loader worker tokenises only the documents of its own windows."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

import disttrain.data.mixture_stream as mixture_stream
import disttrain.data.token_cache as token_cache
from disttrain.data import MixtureConfig, MixtureSource
from disttrain.data.mixture_stream import DocumentTokens, MixtureStream, MixtureWindows, RankShare, StreamState
from disttrain.errors import ConfigError
from tests.mixture_corpus import source_texts
from tests.test_mixture import KINDS, corpus, mixture_config  # noqa: F401 (corpus: the module's fixture)
from tests.test_text_data import make_tokenizer, topic_texts


class CountingTokenizer:
    """A tokenizer that records every text it encodes."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001
        self.tokenizer, self.texts = tokenizer, []

    def encode_batch(self, texts, **options):  # noqa: ANN001, ANN201
        self.texts += list(texts)
        return self.tokenizer.encode_batch(texts, **options)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.tokenizer, name)


def test_a_loader_worker_tokenises_only_the_documents_of_its_own_windows(corpus, monkeypatch):  # noqa: F811
    """Worker 1 of 2 on rank 1 of 4 builds micro-batches 1, 3, 5, ...: the texts it hands the tokenizer are exactly
    the documents its windows hold (a window's last target included), each once: fewer than its stretch of the
    stream holds."""
    plan = mixture_config(corpus).plan(seed=4)
    micro, batches = 2, 12
    reference = MixtureStream(plan, StreamState.start(3))
    pieces = [reference.next_window()[1] for _ in range(batches * micro * 4 + 1)]  # type: ignore[index]

    counting = CountingTokenizer(token_cache.load_tokenizer(plan.tokenizer))
    monkeypatch.setattr(token_cache, "load_tokenizer", lambda folder: counting)
    monkeypatch.setattr(mixture_stream, "get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2))
    share = RankShare(micro, 1, 4, 1, 0, batches)
    read = list(MixtureWindows(plan, StreamState.start(3), share))

    assert [record["batch"] for _, _, record in read] == list(range(1, batches, 2))
    windows = [share.window(0, batch, sample) for batch in range(1, batches, 2) for sample in range(micro)]
    assert [record["pieces"] for _, _, record in read] == [
        [[list(piece) for piece in pieces[window]] for window in windows[index:index + micro]]
        for index in range(0, len(windows), micro)]
    held = {(source, document, passes) for window in windows for source, document, passes, _, _ in
            [*pieces[window], pieces[window + 1][0]]}  # the next window's first document holds the last target
    texts = source_texts()
    expected = sorted(texts[KINDS[source]][document] for source, document, _ in held)
    stream = {piece[:3] for window in pieces[:windows[-1] + 2] for piece in window}
    print(f"worker 1 of 2 on rank 1 of 4 tokenised {len(counting.texts)} documents of the {len(stream)} its "
          f"stretch of the stream holds")
    assert sorted(counting.texts) == expected
    assert len(counting.texts) == len(held) < len(stream)


def test_ranks_share_only_the_documents_across_the_edges_of_their_runs_of_windows(corpus):  # noqa: F811
    """Each of 2 ranks reads its micro-batch of 8 consecutive windows per round, so the two tokenise together the
    stream's documents and, at most, one more per edge between one rank's run and the next (each rank tokenising
    every other window would tokenise most documents twice)."""
    plan = mixture_config(corpus).plan(seed=6)
    micro, batches, ranks = 8, 4, 2
    reference = MixtureStream(plan, StreamState.start(3))
    pieces = [reference.next_window()[1] for _ in range(batches * micro * ranks + 1)]  # type: ignore[index]
    stream = {piece[:3] for window in pieces for piece in window}
    counts = []
    for rank in range(ranks):
        windows = MixtureWindows(plan, StreamState.start(3), RankShare(micro, 1, ranks, rank, 0, batches))
        tokens = DocumentTokens(plan)
        assert len(list(windows.batches(0, 1, tokens))) == batches
        counts.append(tokens.tokenised)
    edges = batches * ranks - 1
    print(f"2 ranks tokenise {counts} documents of the stream's {len(stream)}, with {edges} edges between runs")
    assert len(stream) <= sum(counts) <= len(stream) + edges


def short_texts() -> list[str]:
    """Twenty short documents, each of another length."""
    return [text[:30 + 7 * number] for number, text in enumerate(topic_texts()[20:40])]


def write_jsonl(path: Path, texts: list[str]) -> None:
    """One JSON line per text, under ``text``."""
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")


def jsonl_config(folder: Path, tokenizer: Path) -> MixtureConfig:
    """A mixture of one JSON-lines source, ``folder/docs.jsonl``, its index cached in ``folder/cache``."""
    return MixtureConfig(sources=[MixtureSource(str(folder / "docs.jsonl"))], tokenizer=str(tokenizer),
                         block_size=16, val_documents=2, cache_dir=str(folder / "cache"))


def test_the_index_is_built_once_read_by_later_processes_and_rebuilt_when_a_source_changes(tmp_path, monkeypatch):
    """The first validation builds the index (a notice says so); a later one, as a rank's, opens it without reading
    a document; changing the file builds a new index, whose stream reads the new documents."""
    tokenizer = make_tokenizer(tmp_path / "tok")
    texts = short_texts()
    write_jsonl(tmp_path / "docs.jsonl", texts)
    config = jsonl_config(tmp_path, tokenizer)
    notices = config.validate()
    assert len(notices) == 1 and "20 documents" in notices[0] and str(tmp_path / "cache") in notices[0]

    import disttrain.data.length_index as length_index

    def no_reading(*_: object) -> None:
        raise AssertionError("a document was read although the index exists")

    with monkeypatch.context() as patched:
        patched.setattr(length_index, "scan_file", no_reading)
        assert config.validate() == []
        assert config.plan(seed=0).sources[0].num_documents == 20

    changed = [text.upper() for text in texts[:12]]
    write_jsonl(tmp_path / "docs.jsonl", changed)
    notices = config.validate()
    assert len(notices) == 1 and "12 documents" in notices[0]
    assert len(os.listdir(tmp_path / "cache")) == 2  # the old index is left for the files it describes
    plan = config.plan(seed=0)
    stream = MixtureStream(plan, StreamState.start(1))
    read = [stream.next_window() for _ in range(40)]
    first_pass = {document for _, pieces in read for _, document, passes, _, _ in pieces if passes == 0}
    assert first_pass == set(range(10))  # the 10 training documents of the new file
    ids = token_cache.load_tokenizer(str(tokenizer)).encode(changed[0], add_special_tokens=False).ids
    shown = min(len(ids), 17)
    assert read[0][0].tolist()[:shown] == ids[:shown]


def test_a_change_the_index_key_cannot_see_is_refused_when_the_document_is_read(tmp_path):
    """A file rewritten with its size and modification time kept reads through its old index: the worker that
    tokenises a document of another length refuses in one line naming the source and the file."""
    tokenizer = make_tokenizer(tmp_path / "tok")
    texts = short_texts()
    write_jsonl(tmp_path / "docs.jsonl", texts)
    config = jsonl_config(tmp_path, tokenizer)
    config.validate()
    stat = os.stat(tmp_path / "docs.jsonl")
    swapped = [texts[1], texts[0], *texts[2:]]  # same bytes in all, two documents of other lengths swapped
    write_jsonl(tmp_path / "docs.jsonl", swapped)
    os.utime(tmp_path / "docs.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    stream = MixtureStream(config.plan(seed=0), StreamState.start(1))
    with pytest.raises(ConfigError) as err:
        for _ in range(40):
            stream.next_window()
    assert err.value.key == "data.sources[0].path" and "docs.jsonl" in str(err.value)
    assert "length index" in str(err.value) and "\n" not in str(err.value)

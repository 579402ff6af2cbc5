"""The mixture's one global stream read as windows, and where a rank's loader worker finds its own windows in it.

Where every document lies is arithmetic on the sources' length indexes (``disttrain.data.mixture_layout``); reading
and tokenising is done only for the documents of the windows a worker builds. The ranks read the epoch's windows in
rounds of ``m x R`` (``m`` windows per micro-batch, ``R`` data-parallel ranks): in round ``i`` rank ``r`` reads, as its
micro-batch ``i``, the ``m`` consecutive windows from ``(i * R + r) * m``. Consecutive windows share the documents
that run across them, so a rank taking a run of them tokenises those documents once where ranks taking every
``R``-th window would each tokenise nearly all of them. After ``i`` micro-batches per rank the ranks together have
read exactly the first ``i * m * R`` windows, whatever ``m`` and ``R`` are (the count in global samples that
``disttrain.data.position`` keeps for every data set), and a round's windows are one global step's (or one
accumulation micro-step's) whatever rank reads which. Loader worker ``w`` of ``W`` builds its rank's micro-batches
``w, w + W, ...``, which a DataLoader hands out in turn; it places the documents of the whole stream up to its last
window from their lengths, and reads and tokenises only those its own windows hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from disttrain.data.mixture_layout import MixturePlan, Placed, StreamLayout, StreamState
from disttrain.errors import ConfigError

__all__ = ["DocumentTokens", "MixturePlan", "MixtureStream", "MixtureWindows", "RankShare", "StreamState",
           "continue_after", "held_out_tokens"]

Piece = tuple[int, int, int, int, int]
"""A window's piece of a document: ``(source, document, pass, first, last)``, ``last`` exclusive, in the document's
tokens with its end token."""


class DocumentTokens:
    """The token ids (end-of-document id included) of placed documents, read and tokenised on request, a request's
    documents in one call to the tokenizer; the documents of the last request are kept for the next (a document may
    run on into the next window). ``tokenised`` and ``tokenised_tokens`` count what was tokenised."""

    def __init__(self, plan: MixturePlan) -> None:
        from disttrain.data.token_cache import load_tokenizer

        self.plan = plan
        self.tokenizer = load_tokenizer(plan.tokenizer)
        self.readers = [source.reader() for source in plan.sources]
        self.tokenised = 0
        """Documents tokenised by this object."""
        self.tokenised_tokens = 0
        """Their tokens, end-of-document tokens included."""
        self._kept: dict[int, np.ndarray] = {}

    def ids(self, placed: list[Placed]) -> dict[int, np.ndarray]:
        """Each of ``placed``'s ids, by draw."""
        found = {document.draw: self._kept[document.draw] for document in placed if document.draw in self._kept}
        missing = list({document.draw: document for document in placed if document.draw not in found}.values())
        texts = [self.readers[document.source].text(document.cursor % self.plan.train_documents[document.source])
                 for document in missing]
        end = [self.plan.eos_id]
        for document, encoding in zip(missing, self.tokenizer.encode_batch(texts, add_special_tokens=False),
                                      strict=True):
            ids = np.asarray(encoding.ids + end, dtype=np.int64)
            if len(ids) != document.end - document.start:
                files = self.plan.sources[document.source].files
                raise ConfigError(files.key, files.files, f"files unchanged since their length index was built: "
                                  f"document {document.cursor % self.plan.train_documents[document.source]} now has "
                                  f"{len(ids) - 1} tokens, the index says {document.end - document.start - 1}")
            found[document.draw] = ids
            self.tokenised_tokens += len(ids)
        self.tokenised += len(missing)
        self._kept = found
        return found


def cut_window(position: int, size: int, placed: list[Placed], ids: dict[int, np.ndarray],
               train_documents: tuple[int, ...]) -> tuple[np.ndarray, list[Piece]]:
    """The ``size + 1`` tokens from ``position`` (a window's inputs and its last target) and the pieces of the
    documents its inputs hold, from the documents ``placed`` there and their ids."""
    parts, pieces = [], []
    for document in placed:
        first, last = max(position, document.start), min(document.end, position + size + 1)
        parts.append(ids[document.draw][first - document.start:last - document.start])
        inputs_end = min(document.end, position + size)
        if inputs_end > first:
            count = train_documents[document.source]
            pieces.append((document.source, document.cursor % count, document.cursor // count,
                           first - document.start, inputs_end - document.start))
    return np.concatenate(parts), pieces


class MixtureStream:
    """The stream from a state on: ``next_window()`` gives one window at a time, ``state`` is where the next one
    starts."""

    def __init__(self, plan: MixturePlan, state: StreamState) -> None:
        self.plan = plan
        self.layout = StreamLayout(plan, state)
        self.tokens = DocumentTokens(plan)

    @property
    def state(self) -> StreamState:
        """Where the next window starts."""
        return self.layout.state

    def next_window(self) -> tuple[np.ndarray, list[Piece]] | None:
        """The next window's ``T + 1`` tokens and its pieces, ``(source, document, pass, first, last)`` per
        document it holds (``last`` exclusive, in the document's tokens with its end token); None at the end."""
        window = self.layout.window
        if not self.layout.holds(window):
            return None
        got = read_windows(self.layout, self.tokens, [window])[0]
        self.layout.move_to(window + 1)
        return got


def read_windows(layout: StreamLayout, tokens: DocumentTokens,
                 windows: list[int]) -> list[tuple[np.ndarray, list[Piece]]]:
    """The tokens and pieces of ``windows`` (at or after the layout's current window, held by the stream), their
    documents tokenised in one call."""
    placed = [layout.documents_in(window) for window in windows]
    ids = tokens.ids([document for documents in placed for document in documents])
    plan = layout.plan
    return [cut_window(layout.position(window), plan.block_size, documents, ids, plan.train_documents)
            for window, documents in zip(windows, placed, strict=True)]


@dataclass(frozen=True)
class RankShare:
    """Which micro-batches of an epoch one rank reads, and where in the stream the epoch stands."""

    micro_size: int
    """Windows per micro-batch."""
    accumulation: int
    """Micro-batches per optimiser step on each rank (an epoch ends at its last whole global step)."""
    replicas: int
    """Data-parallel ranks."""
    rank: int
    """This rank's data-parallel index."""
    first_batch: int
    """The first of this rank's micro-batches to read in the epoch (past it in a resumed epoch)."""
    batches: int
    """This rank's micro-batches in a whole epoch."""

    def window(self, base: int, batch: int, sample: int) -> int:
        """Global window of sample ``sample`` of this rank's micro-batch ``batch``, in an epoch starting at
        ``base``."""
        return base + (batch * self.replicas + self.rank) * self.micro_size + sample

    def after(self, base: int, batch: int) -> int:
        """The global window every rank has reached once each has read micro-batches up to ``batch``."""
        return base + (batch + 1) * self.micro_size * self.replicas

    def step_end(self, base: int, batch: int) -> int:
        """The window after the last of ``batch``'s optimiser step (the step is read only if the stream holds it)."""
        step = batch // self.accumulation
        return base + (step + 1) * self.accumulation * self.micro_size * self.replicas


class MixtureWindows(IterableDataset):
    """One rank's training micro-batches of an epoch: ``(inputs, targets, read)`` with ``read`` the micro-batch's
    index, the stream state after it (``StreamState.to_dict``) and each window's pieces of documents.

    Starts from ``start``, the state at this rank's ``share.first_batch``; a loader worker builds every
    ``num_workers``-th micro-batch (see the module's docstring)."""

    def __init__(self, plan: MixturePlan, start: StreamState, share: RankShare) -> None:
        self.plan, self.start, self.share = plan, start, share

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.batches(worker, workers, DocumentTokens(self.plan))

    def batches(self, worker: int, workers: int,
                tokens: DocumentTokens) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
        """The micro-batches loader worker ``worker`` of ``workers`` builds, its documents read and tokenised by
        ``tokens``: only those of its own windows."""
        share = self.share
        base = self.start.window - share.first_batch * share.micro_size * share.replicas
        layout = StreamLayout(self.plan, self.start)
        for batch in range(share.first_batch + worker, share.batches, workers):
            if not layout.holds(share.step_end(base, batch) - 1):
                return  # the epoch ended with a source, before this micro-batch's step was whole
            windows = [share.window(base, batch, sample) for sample in range(share.micro_size)]
            rows = read_windows(layout, tokens, windows)
            layout.move_to(share.after(base, batch))
            yield self._batch(batch, rows, layout.state)

    def _batch(self, batch: int, rows: list[Any], after: StreamState) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  dict[str, Any]]:
        chunk = torch.from_numpy(np.stack([tokens for tokens, _ in rows]))
        pieces = [[list(piece) for piece in window_pieces] for _, window_pieces in rows]
        return chunk[:, :-1], chunk[:, 1:], {"batch": batch, "state": after.to_dict(), "pieces": pieces}


def held_out_tokens(plan: MixturePlan, source: int) -> np.ndarray:
    """A source's held-out documents (those after its training documents), tokenised and each followed by the
    end-of-document id, in order."""
    from disttrain.data.token_cache import load_tokenizer

    tokenizer = load_tokenizer(plan.tokenizer)
    indexed, reader = plan.sources[source], plan.sources[source].reader()
    try:
        texts = [reader.text(index) for index in range(plan.train_documents[source], indexed.num_documents)]
    finally:
        reader.close()
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.asarray([token for encoding in encoded for token in (*encoding.ids, plan.eos_id)], dtype=np.int64)


def continue_after(state: StreamState, plan: MixturePlan, epoch: int) -> StreamState:
    """Where epoch ``epoch`` starts, ``state`` being where the one before it ended: the same place in the stream
    when sources wrap, the beginning of a stream keyed by ``epoch`` when an epoch ends with a source."""
    if plan.wrap:
        return state
    return StreamState.start(len(plan.sources), epoch, after=state)


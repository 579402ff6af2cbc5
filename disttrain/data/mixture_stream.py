"""The mixture's one global stream: documents drawn by weight, tokenised, joined by the end-of-document token and cut
into windows; and where a rank's loader worker finds its own windows in it.

Draw ``k`` of a stream picks source ``s`` from ``counter_random(seed, epoch, k)`` in proportion to the weights; the
document it reads is that source's next one (its cursor), so the sequence of documents depends on the seed alone.
Each document's tokens are followed by the end-of-document id and the documents are concatenated; window ``w`` is
tokens ``w*T`` to ``w*T + T`` of that concatenation (inputs the first ``T``, targets the last ``T``). A position in
the stream is a ``StreamState``: the draw being read, every source's cursor before it, and the tokens of that
document already read; a state is all a run needs to continue the stream, on any number of ranks or workers.

Rank ``r`` of ``R`` reads the global windows ``r, r + R, r + 2R, ...`` of its epoch, a micro-batch of ``m`` of them
at a time, as ``disttrain.data.position`` has it for every data set; loader worker ``w`` of ``W`` builds that rank's
micro-batches ``w, w + W, ...``, which a DataLoader hands out in turn. Every worker walks the whole stream (a
window's place depends on the length of every document before it) and keeps its own windows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from disttrain.counter_random import counter_random, counter_random_array
from disttrain.data.sources import SourceFiles

DRAWS_AT_ONCE = 64
"""Documents drawn, read and handed to the tokenizer together (it encodes a batch on several threads)."""
STREAM_SALT = 0x4D49585455524553
"""Mixed into the run's seed so the mixture's draws share no numbers with other uses of the seed."""


@dataclass(frozen=True)
class StreamState:
    """A position in the stream: what a checkpoint saves and a resumed loader starts from."""

    epoch: int
    """Key of the draws: 0 throughout when sources wrap, the epoch when an epoch ends with a source."""
    draws: int
    """Index of the draw whose document is being read."""
    cursors: tuple[int, ...]
    """Documents each source had given before that draw (past its end when it wrapped)."""
    offset: int
    """Tokens of that document (its end-of-document token included) already read."""
    window: int
    """Windows read since the run began."""
    tokens: tuple[int, ...]
    """Window tokens (inputs) read from each source since the run began."""
    documents: tuple[int, ...]
    """Documents begun in each source since the run began."""

    def to_dict(self) -> dict[str, Any]:
        """The state as plain lists and ints (what a checkpoint and a loader worker's batch carry)."""
        return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(self).items()}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> StreamState:
        """The state ``to_dict`` wrote."""
        return cls(**{name: tuple(value) if isinstance(value, list) else int(value) for name, value in saved.items()})

    @classmethod
    def start(cls, sources: int, epoch: int = 0, after: StreamState | None = None) -> StreamState:
        """The beginning of a stream keyed by ``epoch``; counts of windows, tokens and documents go on from
        ``after`` (the previous epoch's end) where given."""
        zeros = (0,) * sources
        if after is None:
            return cls(epoch, 0, zeros, 0, 0, zeros, zeros)
        return cls(epoch, 0, zeros, 0, after.window, after.tokens, after.documents)


@dataclass(frozen=True)
class MixturePlan:
    """Everything a worker needs to rebuild the stream: the sources, their weights, the tokenizer, the sizes."""

    sources: tuple[SourceFiles, ...]
    """Each source's files and document counts."""
    train_documents: tuple[int, ...]
    """Documents of each source used for training (the rest, at its end, are held out)."""
    weights: tuple[float, ...]
    """Each source's weight (not normalised)."""
    tokenizer: str
    """Folder of ``tokenizer.json``; every process loads its own."""
    eos_id: int
    """End-of-document id placed after every document."""
    block_size: int
    """Tokens per window."""
    seed: int
    """The run's seed."""
    wrap: bool
    """A source that runs out starts again (True) or ends the epoch (False)."""

    def source_of(self, epoch: int, draws: np.ndarray) -> np.ndarray:
        """The source each of ``draws`` picks: uniform numbers from the counter-based generator, split in
        proportion to the weights."""
        bits = counter_random_array(counter_random(self.seed, STREAM_SALT, 0), np.full(len(draws), epoch), draws)
        uniform = (bits >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        bounds = np.cumsum(self.weights) / sum(self.weights)
        return np.minimum(np.searchsorted(bounds, uniform, side="right"), len(self.weights) - 1)


@dataclass
class _Document:
    """A drawn document waiting in the stream, with the state before its draw."""

    draws: int
    source: int
    index: int
    cursors: tuple[int, ...]
    ids: np.ndarray = field(repr=False)


class _SourceReader:
    """Sequential reads of one source's training documents, reopened only when a read does not follow the last."""

    def __init__(self, source: SourceFiles, documents: int) -> None:
        self.source, self.documents = source, documents
        self._next: int | None = None
        self._texts: Iterator[str] = iter(())

    def read(self, cursor: int) -> str:
        """The text of document ``cursor % documents`` (a cursor past the end has wrapped)."""
        index = cursor % self.documents
        if index != self._next:
            self._texts = self.source.documents(index, self.documents)
        self._next = index + 1
        return next(self._texts)


class MixtureStream:
    """The stream from a state on: ``next_window()`` gives one window at a time, ``state`` is where the next one
    starts."""

    def __init__(self, plan: MixturePlan, state: StreamState) -> None:
        from disttrain.data.token_cache import load_tokenizer

        self.plan = plan
        self.tokenizer = load_tokenizer(plan.tokenizer)
        self.readers = [_SourceReader(source, count) for source, count in zip(plan.sources, plan.train_documents,
                                                                             strict=True)]
        self._pending: deque[_Document] = deque()
        self._draws, self._cursors = state.draws, list(state.cursors)
        self._ended = False
        self._offset = state.offset
        self._counts = (state.window, list(state.tokens), list(state.documents))
        self._epoch = state.epoch

    @property
    def state(self) -> StreamState:
        """Where the next window starts."""
        window, tokens, documents = self._counts
        if not self._fill(1):
            return StreamState(self._epoch, self._draws, tuple(self._cursors), 0, window, tuple(tokens),
                               tuple(documents))
        head = self._pending[0]
        return StreamState(self._epoch, head.draws, head.cursors, self._offset, window, tuple(tokens),
                           tuple(documents))

    def next_window(self) -> tuple[np.ndarray, list[tuple[int, int, int, int, int]]] | None:
        """The next window's ``T + 1`` tokens and its pieces, ``(source, document, pass, first, last)`` per
        document it holds (``last`` exclusive, in the document's tokens with its end token); None at the end."""
        size = self.plan.block_size
        if not self._fill(size + 1):
            return None
        window, tokens, documents = self._counts
        parts, pieces, offset, taken = [], [], self._offset, 0
        for document in self._pending:
            if taken > size:
                break
            part = document.ids[offset:offset + size + 1 - taken]
            parts.append(part)
            inputs = min(len(part), size - taken)
            if inputs > 0:
                count = self.plan.train_documents[document.source]
                pieces.append((document.source, document.index % count, document.index // count, offset,
                               offset + inputs))
                tokens[document.source] += inputs
                documents[document.source] += offset == 0
            taken += len(part)
            offset = 0
        self._advance(size)
        self._counts = (window + 1, tokens, documents)
        return np.concatenate(parts), pieces

    def _advance(self, count: int) -> None:
        """Move the position ``count`` tokens on, dropping the documents read to their end."""
        self._offset += count
        while self._pending and self._offset >= len(self._pending[0].ids):
            self._offset -= len(self._pending.popleft().ids)

    def _fill(self, tokens: int) -> bool:
        """Draw until at least ``tokens`` tokens wait from the position on; False if the stream ends first."""
        while sum(len(document.ids) for document in self._pending) - self._offset < tokens:
            if self._ended or not self._draw():
                return False
        return True

    def _draw(self) -> bool:
        """Draw, read and tokenise the next ``DRAWS_AT_ONCE`` documents; False if the stream has ended."""
        plan = self.plan
        sources = plan.source_of(self._epoch, np.arange(self._draws, self._draws + DRAWS_AT_ONCE))
        drawn: list[_Document] = []
        texts: list[str] = []
        for source in sources.tolist():
            cursor = self._cursors[source]
            if not plan.wrap and cursor >= plan.train_documents[source]:
                self._ended = True
                break
            texts.append(self.readers[source].read(cursor))
            drawn.append(_Document(self._draws, source, cursor, tuple(self._cursors), np.empty(0, np.int64)))
            self._cursors[source] += 1
            self._draws += 1
        end = [plan.eos_id]
        for document, encoding in zip(drawn, self.tokenizer.encode_batch(texts, add_special_tokens=False),
                                      strict=True):
            document.ids = np.asarray(encoding.ids + end, dtype=np.int64)
        self._pending.extend(drawn)
        return bool(drawn)


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
        return base + (batch * self.micro_size + sample) * self.replicas + self.rank

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
        share = self.share
        mine = range(share.first_batch + worker, share.batches, workers)
        if not mine:
            return
        base = self.start.window - share.first_batch * share.micro_size * share.replicas
        wanted = {share.window(base, batch, sample): (batch, sample) for batch in mine
                  for sample in range(share.micro_size)}
        afters = {share.after(base, batch): batch for batch in mine}
        stream = MixtureStream(self.plan, self.start)
        rows: dict[int, list[Any]] = {batch: [None] * share.micro_size for batch in mine}
        states: dict[int, StreamState] = {}
        for batch in mine:
            while stream.state.window < share.step_end(base, batch):
                self._note_state(stream.state, afters, states)
                window = stream.state.window
                got = stream.next_window()
                if got is None:
                    return  # the epoch ended with a source, before this micro-batch's step was whole
                if window in wanted:
                    owner, sample = wanted.pop(window)
                    rows[owner][sample] = got
            self._note_state(stream.state, afters, states)
            yield self._batch(batch, rows.pop(batch), states.pop(batch))

    @staticmethod
    def _note_state(state: StreamState, afters: dict[int, int], states: dict[int, StreamState]) -> None:
        """Keep ``state`` as the state after a micro-batch of this worker's that ends there."""
        if state.window in afters:
            states[afters[state.window]] = state

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
    files = plan.sources[source]
    texts = list(files.documents(plan.train_documents[source], files.num_documents))
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return np.asarray([token for encoding in encoded for token in (*encoding.ids, plan.eos_id)], dtype=np.int64)


def continue_after(state: StreamState, plan: MixturePlan, epoch: int) -> StreamState:
    """Where epoch ``epoch`` starts, ``state`` being where the one before it ended: the same place in the stream
    when sources wrap, the beginning of a stream keyed by ``epoch`` when an epoch ends with a source."""
    if plan.wrap:
        return state
    return StreamState.start(len(plan.sources), epoch, after=state)


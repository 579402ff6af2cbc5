"""The mixture stream's arithmetic: which document each draw reads and where its tokens lie, from the documents'
lengths alone (each source's length index), so that no process reads or tokenises a document to find a place.

Draw ``k`` of a stream picks source ``s`` from ``counter_random(seed, epoch, k)`` in proportion to the weights; the
document it reads is that source's next one (its cursor), so the sequence of documents depends on the seed alone.
Each document's tokens are followed by the end-of-document id and the documents are concatenated; window ``w`` is
tokens ``w*T`` to ``w*T + T`` of that concatenation (inputs the first ``T``, targets the last ``T``). A position in
the stream is a ``StreamState``: the draw being read, every source's cursor before it, and the tokens of that
document already read; a state is all a run needs to continue the stream, on any number of ranks or workers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from disttrain.counter_random import counter_random, counter_random_array
from disttrain.data.length_index import IndexedSource

PLACED_AT_ONCE = 4096
"""Draws placed together (their sources, cursors and token spans computed as arrays)."""
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

    sources: tuple[IndexedSource, ...]
    """Each source's files, document counts and length index."""
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


class Placed(NamedTuple):
    """A drawn document and where its tokens lie in the stream."""

    draw: int
    """The draw's index in its epoch's stream."""
    source: int
    """The source it was drawn from."""
    cursor: int
    """That source's documents given before it (its document is ``cursor % training documents``)."""
    start: int
    """Position of its first token, counted from the layout's first window."""
    end: int
    """Position after its end-of-document token."""


class StreamLayout:
    """Every drawn document's place in the stream from a state on, computed from lengths alone and walked forward:
    ``holds`` and ``documents_in`` a window at or after the current one, ``move_to`` a later window (counting the
    tokens and documents read on the way), ``state`` the current window's ``StreamState``."""

    def __init__(self, plan: MixturePlan, state: StreamState) -> None:
        self.plan = plan
        self.block = plan.block_size
        self._lengths = [source.lengths() for source in plan.sources]
        self._train = np.asarray(plan.train_documents, dtype=np.int64)
        self._epoch, self._origin = state.epoch, state.window
        sources = len(plan.sources)
        # the placed draws not yet passed, as parallel arrays
        self._draw = self._source = self._cursor = self._start = self._end = np.zeros(0, np.int64)
        self._before = np.zeros((0, sources), np.int64)
        """Every source's cursor before each placed draw."""
        self._next_draw, self._next_cursors = state.draws, np.asarray(state.cursors, dtype=np.int64)
        self._next_start = -state.offset
        self._ended = False
        self._window = state.window
        self._tokens = np.asarray(state.tokens, dtype=np.int64)
        self._documents = np.asarray(state.documents, dtype=np.int64)

    @property
    def window(self) -> int:
        """The current window."""
        return self._window

    def position(self, window: int) -> int:
        """Position of ``window``'s first token."""
        return (window - self._origin) * self.block

    def holds(self, window: int) -> bool:
        """Whether the stream holds ``window`` whole (its inputs and the target after them)."""
        return self._reach(self.position(window) + self.block + 1)

    def documents_in(self, window: int) -> list[Placed]:
        """The documents with a token among ``window``'s ``T + 1`` (a window the stream holds)."""
        first = self.position(window)
        self._reach(first + self.block + 1)
        lo = int(np.searchsorted(self._end, first, side="right"))
        hi = int(np.searchsorted(self._start, first + self.block + 1, side="left"))
        return [Placed(int(self._draw[i]), int(self._source[i]), int(self._cursor[i]), int(self._start[i]),
                       int(self._end[i])) for i in range(lo, hi)]

    def move_to(self, window: int) -> None:
        """Make ``window`` (at or after the current one) the current one, counting the input tokens of the windows
        passed per source and the documents begun in them."""
        if window < self._window:
            raise ValueError(f"the layout walks forward: window {window} is before {self._window}")
        old, new = self.position(self._window), self.position(window)
        self._reach(new)
        overlap = np.clip(np.minimum(self._end, new) - np.maximum(self._start, old), 0, None)
        sources = len(self.plan.sources)
        self._tokens += np.bincount(self._source, weights=overlap, minlength=sources).astype(np.int64)
        begun = (self._start >= old) & (self._start < new)
        self._documents += np.bincount(self._source[begun], minlength=sources)
        self._window = window
        self._keep(self._end > new)

    @property
    def state(self) -> StreamState:
        """The state at the current window's first token."""
        position = self.position(self._window)
        counts = (self._window, tuple(self._tokens.tolist()), tuple(self._documents.tolist()))
        if not self._reach(position + 1):
            return StreamState(self._epoch, self._next_draw, tuple(self._next_cursors.tolist()), 0, *counts)
        index = int(np.searchsorted(self._end, position, side="right"))
        return StreamState(self._epoch, int(self._draw[index]), tuple(self._before[index].tolist()),
                           position - int(self._start[index]), *counts)

    def _keep(self, kept: np.ndarray) -> None:
        """Keep only the placed draws ``kept`` marks."""
        self._draw, self._source, self._cursor = self._draw[kept], self._source[kept], self._cursor[kept]
        self._start, self._end, self._before = self._start[kept], self._end[kept], self._before[kept]

    def _reach(self, position: int) -> bool:
        """Place draws until their tokens reach ``position``; False if the stream ends before."""
        while self._next_start < position:
            if self._ended:
                return False
            self._place()
        return True

    def _place(self) -> None:
        """Place the next ``PLACED_AT_ONCE`` draws (fewer where a source that does not wrap runs out, which ends
        the stream)."""
        plan, sources = self.plan, len(self.plan.sources)
        draws = np.arange(self._next_draw, self._next_draw + PLACED_AT_ONCE, dtype=np.int64)
        source = plan.source_of(self._epoch, draws).astype(np.int64)
        picked = (source[:, None] == np.arange(sources)).astype(np.int64)
        before = self._next_cursors + np.cumsum(picked, axis=0) - picked
        cursor = before[np.arange(len(draws)), source]
        after = before[-1] + picked[-1]
        if not plan.wrap:
            out = cursor >= self._train[source]
            if out.any():
                cut = int(np.argmax(out))
                draws, source, cursor, before, after = draws[:cut], source[:cut], cursor[:cut], before[:cut], \
                    before[cut]
                self._ended = True
        length = np.empty(len(draws), dtype=np.int64)
        for index in range(sources):
            mine = source == index
            if mine.any():
                length[mine] = self._lengths[index][cursor[mine] % self._train[index]].astype(np.int64) + 1
        end = self._next_start + np.cumsum(length)
        self._draw, self._source = np.concatenate([self._draw, draws]), np.concatenate([self._source, source])
        self._cursor, self._before = np.concatenate([self._cursor, cursor]), np.concatenate([self._before, before])
        self._start, self._end = np.concatenate([self._start, end - length]), np.concatenate([self._end, end])
        self._next_draw += len(draws)
        self._next_cursors = after
        if len(draws):
            self._next_start = int(end[-1])

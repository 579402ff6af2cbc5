"""Several text sources mixed by weight and read as they stream (``data=mixture``).

Contract with the models: a training or validation window is ``block_size`` tokens packed from whole documents, each
document's tokens followed by the end-of-document id (``DataSpec.document_end``). The boundaries are implied by that
id alone: token ``i`` of a window belongs to the document that the first end-of-document token at or after ``i``
closes, so the number of end-of-document tokens before ``i`` is its document's index within the window (the end
token itself belongs to the document it closes; a window's first tokens may continue a document begun in the window
before). ``DataSpec.document_end`` is None when ``data.document_mask`` is false: then windows attend across
documents.

The order of documents is one global stream (``disttrain.data.mixture_layout``), the same for every number of
ranks, loader workers and micro-batch size. Validation (in the job process, before ranks start) builds each source's
length index (``disttrain.data.length_index``), from which every worker places the documents and tokenises only
those of its own windows (``disttrain.data.mixture_stream``). A checkpoint saves the stream's position (the draw,
every source's cursor and the tokens of the current document read) beside the position in global samples, so a
resumed run on any data-parallel size or worker count reads exactly what it had not read. What was read (tokens and
documents per source, against the weights) goes to ``results.json``; ``data.read_log`` writes every trained window's
documents.
"""

from __future__ import annotations

import bisect
import json
import os
from functools import cached_property
from typing import Any

import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from disttrain.data.base import DataModule
from disttrain.data.mixture_config import MixtureConfig
from disttrain.data.mixture_layout import MixturePlan, StreamState
from disttrain.data.mixture_stream import MixtureWindows, RankShare, continue_after, held_out_tokens
from disttrain.data.position import epoch_position
from disttrain.data.registry import DATA
from disttrain.data.spec import DataSpec
from disttrain.data.windows import TokenWindows
from disttrain.errors import ConfigError


@DATA.register("mixture", MixtureConfig)
class MixtureDataModule(DataModule):
    """Next-token prediction on a weighted mixture of streamed text sources, packed into windows."""

    def __init__(self, cfg: MixtureConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        from disttrain.data.token_cache import load_tokenizer

        self.cfg = cfg
        self.plan = cfg.plan(seed)
        vocab_size = load_tokenizer(self.plan.tokenizer).get_vocab_size(with_added_tokens=True)
        self._spec = DataSpec(kind="text", vocab_size=vocab_size, block_size=cfg.block_size,
                              document_end=self.plan.eos_id if cfg.document_mask else None,
                              eval_sources=cfg.source_names())
        self._epoch = 0
        self._after: dict[int, StreamState] = {}
        """The stream's state after each micro-batch this rank has read in the current epoch."""
        self._epoch_start: StreamState | None = None
        self._unlogged: list[dict[str, Any]] = []
        self.read: dict[str, Any] | None = None
        """What the fit read (``read_summary``), set when it ends."""

    @property
    def spec(self) -> DataSpec:
        """Text, the tokenizer's vocabulary, the block size and the end-of-document id of the packed windows."""
        return self._spec

    @property
    def num_train_samples(self) -> int:
        """``data.samples_per_epoch``: the stream has no end of its own."""
        return self.cfg.samples_per_epoch

    def _datasets(self) -> dict[str, Dataset]:
        val = self.val_windows()
        return {"train": _NoMapAccess(self.num_train_samples), "val": val, "test": val}

    def val_windows(self) -> Dataset:
        """Each source's held-out documents as consecutive windows, source after source, each window's targets
        tagged with its source's index (``SourceTaggedWindows``)."""
        windows = []
        for source in range(len(self.plan.sources)):
            tokens = held_out_tokens(self.plan, source)
            if len(tokens) < self.cfg.block_size + 1:
                raise ConfigError("data.val_documents", self.cfg.val_documents,
                                  f"enough held-out documents for one window in every source; "
                                  f"{self.cfg.sources[source].path} gives {len(tokens)} tokens")
            windows.append(TokenWindows(tokens, self.cfg.block_size, self.cfg.val_windows))
        return SourceTaggedWindows(windows)

    @cached_property
    def batches_per_epoch(self) -> int:
        """This rank's micro-batches in a whole epoch (whole global steps of ``data.samples_per_epoch``)."""
        replicas, _ = self.replicas(train=True)
        global_batch = self.micro_batch_size * self.accumulation * replicas
        return self.num_train_samples // global_batch * self.accumulation

    def train_dataloader(self) -> _MixtureLoader:
        """This rank's share of the stream, a micro-batch at a time, from where the run stands."""
        return _MixtureLoader(self)

    def epoch_start(self, epoch: int) -> tuple[StreamState, int]:
        """The stream state at this rank's first micro-batch of ``epoch`` and that micro-batch's index (past 0 in
        a resumed epoch)."""
        replicas, _ = self.replicas(train=True)
        sources = len(self.plan.sources)
        resume = self._resume
        if resume and "stream" in resume:
            saved = StreamState.from_dict(resume["stream"])
            if resume["epoch"] == epoch:
                return saved, int(resume["samples"]) // (self.micro_batch_size * replicas)
            if resume["epoch"] < epoch:
                return continue_after(saved, self.plan, epoch), 0
        if self._after and self._epoch == epoch - 1:
            return continue_after(self._after[max(self._after)], self.plan, epoch), 0
        return StreamState.start(sources, 0 if self.plan.wrap else epoch), 0

    def begin_epoch(self, epoch: int) -> MixtureWindows:
        """This rank's dataset for ``epoch``; what the previous epoch read is logged, as every batch of it trained."""
        start, first = self.epoch_start(epoch)
        self._flush(None)
        self._resume = {}
        self._epoch, self._epoch_start, self._after = epoch, start, {}
        replicas, rank = self.replicas(train=True)
        share = RankShare(self.micro_batch_size, self.accumulation, replicas, rank, first, self.batches_per_epoch)
        return MixtureWindows(self.plan, start, share)

    def note(self, read: dict[str, Any]) -> None:
        """Keep a loader's record of one micro-batch (the state after it, its documents for the log)."""
        self._after[int(read["batch"])] = StreamState.from_dict(read["state"])
        if self.cfg.read_log is not None:
            self._unlogged.append({"epoch": self._epoch, "batch": int(read["batch"]), "windows": read["pieces"]})

    def _state_after(self, processed: int) -> StreamState | None:
        """The stream's state once ``processed`` micro-batches of the current epoch are trained."""
        if processed - 1 in self._after:
            return self._after[processed - 1]
        if processed == 0 or not self._after:
            return self._epoch_start
        return self._after[max(self._after)]

    def state_dict(self) -> dict[str, Any]:
        """The position in global samples and the stream's state there (``StreamState``)."""
        trainer: Any = self.trainer
        if trainer is None:
            return {}
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        position: dict[str, Any] = epoch_position(trainer.current_epoch, processed, self.micro_batch_size,
                                                  self.accumulation, self.replicas(train=True)[0])
        state = self._state_after(processed)
        if state is None and self._resume:
            return dict(self._resume)  # saved before this run read a batch: the position it resumed from
        if state is not None:
            position["stream"] = state.to_dict()
        self._flush(processed)
        return position

    def teardown(self, stage: str) -> None:
        """At the end of a fit: log the last trained micro-batches and keep what the fit read (``read``)."""
        if stage != "fit" or self.trainer is None:
            return
        processed = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        self._flush(processed)
        state = self._state_after(processed)
        if state is None and self._resume.get("stream"):
            state = StreamState.from_dict(self._resume["stream"])
        self.read = read_summary(self.plan, self.cfg, state) if state is not None else None

    def report(self) -> dict[str, Any]:
        """The ``data`` section of ``results.json``: what the training read from each source (empty before any)."""
        return self.read or {}

    def _flush(self, processed: int | None) -> None:
        """Append the logged micro-batches below ``processed`` (all when None) to this rank's read log."""
        if self.cfg.read_log is None or not self._unlogged:
            return
        done = [entry for entry in self._unlogged if processed is None or entry["batch"] < processed]
        self._unlogged = [entry for entry in self._unlogged if entry not in done]
        os.makedirs(self.cfg.read_log, exist_ok=True)
        rank = int(getattr(self.trainer, "global_rank", 0) or 0)
        with open(os.path.join(self.cfg.read_log, f"rank{rank}.jsonl"), "a", encoding="utf-8") as handle:
            for entry in done:
                handle.write(json.dumps(entry) + "\n")


def read_summary(plan: MixturePlan, cfg: MixtureConfig, state: StreamState) -> dict[str, Any]:
    """Tokens and documents read from each source, their shares, the weights' shares and each source's passes."""
    tokens, documents = sum(state.tokens) or 1, sum(state.documents) or 1
    weights = sum(plan.weights)
    sources = []
    for index, source in enumerate(cfg.sources):
        passes = state.cursors[index] / plan.train_documents[index] if plan.wrap else None
        sources.append({"path": source.path, "weight": source.weight,
                        "weight_share": round(plan.weights[index] / weights, 6),
                        "tokens": state.tokens[index], "token_share": round(state.tokens[index] / tokens, 6),
                        "documents": state.documents[index],
                        "document_share": round(state.documents[index] / documents, 6),
                        "passes": round(passes, 4) if passes is not None else None})
    return {"windows": state.window, "tokens": sum(state.tokens), "documents": sum(state.documents),
            "sources": sources}


class SourceTaggedWindows(ConcatDataset):
    """Every source's validation windows, source after source; a window is ``(inputs, targets, sources)``, the last
    its source's index at every target (so that the task reports a loss per source, ``DataSpec.eval_sources``)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, targets = super().__getitem__(index)
        source = bisect.bisect_right(self.cumulative_sizes, index if index >= 0 else len(self) + index)
        return inputs, targets, torch.full_like(targets, source)


class _NoMapAccess(Dataset):
    """The training split's length for the base class's bookkeeping; its windows come from the stream."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        raise TypeError("the mixture's training windows are read in order from its stream (train_dataloader)")


class _MixtureLoader:
    """The training loader Lightning iterates: each epoch a fresh stream reader (a DataLoader over the rank's
    ``MixtureWindows`` when there are workers to run or memory to pin), handing the data module each micro-batch's
    record and Lightning its ``(inputs, targets)``."""

    def __init__(self, data: MixtureDataModule) -> None:
        self.data = data
        self.sampler = self
        """Lightning sets the epoch on a loader's ``sampler``."""
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.data.batches_per_epoch

    def __iter__(self):  # noqa: ANN204 (a generator, so the epoch is read when the first batch is)
        windows = self.data.begin_epoch(self.epoch)
        workers = self.data.num_workers
        batches: Any = windows
        if workers or torch.cuda.is_available():
            batches = DataLoader(windows, batch_size=None, num_workers=workers, pin_memory=torch.cuda.is_available())
        for inputs, targets, read in batches:
            self.data.note(read)
            yield inputs, targets


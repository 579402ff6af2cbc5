"""Pipeline stages of a model whose windows are packed documents (``disttrain.models.documents``).

Stages pass one tensor, the hidden states, so a stage past the first never sees the token ids its attention needs
the document ids of. Every rank of a pipeline is handed the batch's inputs, though: the runtime reads their document
ids once per batch (``MicroBatchDocuments.read``) and each stage sets the ids of the micro-batch it runs on the
model's shared ``PackedDocuments`` before running it, forward and backward alike (``DocumentStage``). Backward needs
them too: a checkpointed block recomputes its forward there, while the schedule may have forwarded later
micro-batches since.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disttrain.models.attention import SequenceSplit
from disttrain.models.documents import PackedDocuments
from disttrain.parallel.pipeline.phases import PhaseStage


def split_of(model: nn.Module) -> SequenceSplit | None:
    """The sequence split the modules of ``model`` hold (None: the sequence is whole on this rank)."""
    return next((m.sequence_split for m in model.modules() if getattr(m, "sequence_split", None) is not None), None)


class MicroBatchDocuments:
    """The document ids of every micro-batch of the current batch, for this rank's stages."""

    def __init__(self, documents: PackedDocuments, split: SequenceSplit | None, microbatches: int) -> None:
        self.documents = documents
        """The documents the model's modules share."""
        self.split = split
        """The sequence split of the model's modules (None: whole sequences)."""
        self.microbatches = microbatches
        """Micro-batches each batch is cut into (as the schedule cuts it: ``torch.tensor_split`` along dim 0)."""
        self.chunks: list[torch.Tensor] = []
        """Document ids of each micro-batch of the batch last read."""

    def read(self, inputs: torch.Tensor) -> None:
        """Take the document ids of the batch's token ids ``inputs`` ``[B, t]``, cut into micro-batches."""
        self.documents.read(inputs, self.split)
        self.chunks = list(self.documents.current().tensor_split(self.microbatches))

    def use(self, chunk: int) -> None:
        """Set the document ids of micro-batch ``chunk`` for the model's modules."""
        self.documents.ids = self.chunks[chunk]


class DocumentStage(PhaseStage):
    """A pipeline stage (marking its phases, ``PhaseStage``) that sets the document ids of the micro-batch it runs,
    forward and backward."""

    def __init__(self, *args: Any, micro_batch_documents: MicroBatchDocuments, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.micro_batch_documents = micro_batch_documents

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """``PhaseStage.forward_one_chunk`` within micro-batch ``fwd_chunk_id``'s documents."""
        self.micro_batch_documents.use(fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """``PhaseStage.backward_one_chunk`` within micro-batch ``bwd_chunk_id``'s documents."""
        self.micro_batch_documents.use(bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """``PhaseStage.backward_weight_one_chunk`` within micro-batch ``bwd_chunk_id``'s documents."""
        self.micro_batch_documents.use(bwd_chunk_id)
        return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

"""The tensor-parallel styles of float8 layers (``trainer.fp8`` under ``parallel.tp``): torchao's
``Float8ColwiseParallel`` and ``Float8RowwiseParallel``.

They split a layer's weight exactly as torch's plain styles do; what differs is where the float8 casts happen. The
layer's input is cast before the style's own redistribution and the gradient reaching its output is cast as it
leaves the style, each scaled by the amax of the whole DTensor (a reduction over the tp ranks), so a collective
between them can carry float8 (on a GPU, under sequence parallelism). Every tp rank scales as one process would;
the gradient is cast before the layer's bias reads it, so biases get their gradients from e5m2 values.

Where a style would gather a float8 tensor along the sequence (a row-wise layer's gradient, a ``sequence_gather``
module's input under sequence parallelism), the layer keeps torch's plain style: torch's CPU kernels cannot
concatenate float8 tensors, so that path could not be checked where the suite runs (``disttrain.parallel.tp``'s
``float8_styled``). torchao's styles take the tensorwise recipe only: a rowwise layer keeps the plain styles.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from disttrain.parallel.float8 import quiet_import


def float8_style(style: str, whole_input: bool, sequence_parallel: bool) -> ParallelStyle:
    """The float8 style of a split plan entry on a float8 layer. ``whole_input``: a row-wise layer that takes a
    whole input; ``sequence_parallel``: a row-wise layer reduce-scatters its output along the sequence."""
    with quiet_import():
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    seq = Shard(1)
    if style == "colwise":
        return Float8ColwiseParallel()
    if style == "colwise_gather":
        return Float8ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise", "rowwise_whole_input"):
        return Float8RowwiseParallel(input_layouts=Replicate() if whole_input else Shard(-1),
                                     output_layouts=seq if sequence_parallel else Replicate())
    raise ValueError(f"tensor-parallel style {style!r} has no float8 form")

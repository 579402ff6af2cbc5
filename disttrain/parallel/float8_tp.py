"""The tensor-parallel styles of float8 layers (``trainer.fp8`` under ``parallel.tp``): torchao's
``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput``.

They split a layer's weight exactly as torch's plain styles do; what differs is where the activation is cast. A
float8 layer's input is cast to float8 before the layer's own redistribution, with the amax of the whole
activation (a DTensor reduction over the tp ranks), and the gradient flowing back into its output is cast the same
way: every tp rank then scales by the same amax as one process would. A plain style on a float8 layer hands the
layer a local slice and the layer scales it by that slice's amax alone (what went wrong in torchtitan's "NaN with TP
>= 2"). Under sequence parallelism a module whose split layers are all float8 gathers its input already in float8
(``PrepareFloat8ModuleInput``), half the bytes of a bf16 gather.

torchao's styles take the tensorwise recipe only: a rowwise layer keeps torch's plain styles, its scales taken per
row of the local slice it multiplies, rows a tp split never cuts in two (``Float8Layers.tensor_parallel_float8``).
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

"""QLoRA's frozen base: the linear layers that carry LoRA adapters, held in 4-bit NormalFloat (nf4) through
bitsandbytes and computed in bf16 (``model.lora.base_dtype=nf4``).

The network is built and its adapters added as for any LoRA run; a rank then swaps each adapted layer's wrapped
``nn.Linear`` (``<module>.base_layer``) for an ``NF4Linear`` once its weights are final (after its layout and
after a folder's weights are read: ``quantise_adapted_bases``). Embeddings, norms and the head stay in the run's
dtype. An ``NF4Linear`` writes its weight into a state dict dequantised (bf16, under the name the ``nn.Linear``
had) and quantises a weight it is loaded with, so checkpoints, resumes and exports see an ordinary bf16 base and
never the 4-bit codes: requantising a dequantised nf4 weight gives the same codes back. Double-quantised
(``model.lora.double_quant``, an ``NF4Format``), the blocks' absmax are held as 8-bit codes too; requantising gives
the same 4-bit codes back, the absmax within their 8-bit rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.errors import ConfigError
from disttrain.quiet_imports import quiet_imports

BLOCK_SIZE = 64
"""Weights per nf4 block (one fp32 absmax each), as QLoRA and bitsandbytes' default."""
COMPUTE_DTYPE = torch.bfloat16
"""The dtype the nf4 weights are dequantised to and multiplied in."""
QUANTISE_BASE = "quantise_base"
"""Attribute of a network whose adapted base layers a rank quantises to nf4 once their weights are final: the
``NF4Format`` they are held in."""


@dataclass(frozen=True)
class NF4Format:
    """How a layer holds its nf4 weight, decided once from ``model.lora`` and handed to every layer quantised."""

    double_quant: bool = False
    """The blocks' fp32 absmax quantised again, to 8 bits in blocks of 256 (QLoRA's double quantisation,
    bitsandbytes' ``compress_statistics``; ``model.lora.double_quant``)."""


def block_statistics(state: Any) -> list[torch.Tensor]:
    """The tensors of bitsandbytes' ``QuantState`` ``state`` that grow with the weights: the blocks' absmax (fp32,
    or 8-bit codes when double-quantised) and, double-quantised, the nested blocks' fp32 absmax and the offset.
    The code books (16 values for nf4, 256 for the nested 8-bit map) are tables of a fixed size and left out."""
    if not state.nested:
        return [state.absmax]
    return [state.absmax, state.state2.absmax, state.offset]


def _pin_dynamic_map_to_cpu() -> None:
    """bitsandbytes (0.50) builds the 8-bit map that double quantisation uses once, on the device of the first
    weight quantised, and moves it to each later weight's device; a first weight on the meta device (the planner's
    pass) would leave a map with no values, which no later weight on a CPU or GPU can copy. Built here on the CPU
    first, it moves anywhere."""
    from bitsandbytes import functional

    if "dynamic" not in functional.name2qmap:
        functional.name2qmap["dynamic"] = functional.create_dynamic_map()


def require_bitsandbytes() -> Any:
    """The ``bitsandbytes`` module (imported quietly: ``disttrain.quiet_imports``); ConfigError naming the extra to
    install when it is missing."""
    try:
        with quiet_imports():
            import bitsandbytes
    except ImportError:
        raise ConfigError("model.lora.base_dtype", "nf4", "keep or bfloat16 unless bitsandbytes is installed "
                          "(pip install 'disttrain[finetune]')") from None
    return bitsandbytes


def check_quantisable(layers: list[tuple[str, nn.Module]]) -> None:
    """ConfigError naming the first of ``layers`` (name, linear layer) whose input width is not a multiple of
    ``BLOCK_SIZE``: bitsandbytes' CPU kernels (0.50) dequantise such a weight with the wrong blocks' scales, so one
    rule holds on every device and a run checked on a CPU computes as it will on a GPU."""
    for name, layer in layers:
        if layer.in_features % BLOCK_SIZE:
            raise ConfigError("model.lora.base_dtype", "nf4", f"keep or bfloat16: nf4 takes linear layers whose "
                              f"input width is a multiple of {BLOCK_SIZE}, and {name} has {layer.in_features} (or "
                              "leave such layers out of model.lora.target_modules)")


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is held as nf4 codes (``uint8``, two per byte) with one absmax per block
    of ``BLOCK_SIZE``; its forward dequantises to bf16 and multiplies there (bitsandbytes' ``matmul_4bit``), and
    passes the gradient to its input. Its bias, if any, stays as it was."""

    def __init__(self, linear: nn.Linear, held_as: NF4Format = NF4Format()) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.held_as = held_as
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8, device=linear.weight.device),
                                   requires_grad=False)
        self.quant_state: Any = None
        """bitsandbytes' ``QuantState`` of ``weight``: the blocks' absmax, nf4's code book, the shape and dtype;
        double-quantised, the absmax as 8-bit codes with their own nested state (``state2``) and offset."""
        self.quantise(linear.weight.detach())
        self.bias = linear.bias  # frozen, as PEFT left it

    def quantise(self, weight: torch.Tensor) -> None:
        """Hold ``weight`` (out x in, any float dtype) as nf4 codes of its bf16 values."""
        from bitsandbytes.functional import quantize_4bit

        if self.held_as.double_quant:
            _pin_dynamic_map_to_cpu()
        codes, self.quant_state = quantize_4bit(weight.to(COMPUTE_DTYPE).contiguous(), blocksize=BLOCK_SIZE,
                                                quant_type="nf4", compress_statistics=self.held_as.double_quant)
        self.weight.data = codes

    def dequantised(self) -> torch.Tensor:
        """The weight the layer computes with (bf16, out x in)."""
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(self.weight.data, self.quant_state)

    def _apply(self, fn, recurse: bool = True) -> NF4Linear:
        # nn.Module moves parameters and buffers alone; the quant state (the blocks' absmax, nf4's code book) follows
        # the codes to their device here, as bitsandbytes' Params4bit.to moves its own. Its kernels read the absmax
        # by pointer, unchecked, so codes on the GPU beside an absmax left on the CPU (a layer quantised on the CPU
        # and then moved) read the wrong memory. The runner quantises on the device, after the move; the layer
        # holds on its own wherever it is moved. QuantState.to moves a double-quantised state's nested absmax, code
        # book and offset too. Only the device follows:
        # a dtype conversion of the module leaves the absmax (and a nested state's scales and offset) in the dtypes
        # the kernels take for them.
        super()._apply(fn, recurse)
        self.quant_state.to(self.weight.device)
        return self

    @property
    def weights(self) -> int:
        """Weights the layer holds (out x in), two to each byte of its codes."""
        return self.out_features * self.in_features

    def held_bytes(self) -> int:
        """Bytes of the quantised weight: its codes and the blocks' statistics (``block_statistics``: the absmax,
        and double-quantised their nested state)."""
        return self.weight.nbytes + sum(tensor.nbytes for tensor in block_statistics(self.quant_state))

    def dequantised_bytes(self) -> int:
        """Bytes of the bf16 weight a forward or backward makes from the codes for its matrix product, freed after
        it: bitsandbytes dequantises the whole weight for the input's gradient, and for the product itself on a
        CPU and, at a training batch's rows, on a GPU."""
        return self.weights * COMPUTE_DTYPE.itemsize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from bitsandbytes import matmul_4bit

        bias = None if self.bias is None else self.bias.to(COMPUTE_DTYPE)
        return matmul_4bit(x.to(COMPUTE_DTYPE), self.weight.t(), self.quant_state, bias=bias).to(x.dtype)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        # the base as the layer computes it, in bf16 under the plain Linear's name: never the 4-bit codes
        destination[prefix + "weight"] = self.dequantised()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
        else:
            weight = state_dict[key]
            if tuple(weight.shape) != (self.out_features, self.in_features):
                error_msgs.append(f"{key}: shape {tuple(weight.shape)}, the layer's "
                                  f"{(self.out_features, self.in_features)}")
            else:
                self.quantise(weight.to(self.weight.device))
        if self.bias is not None:
            if prefix + "bias" in state_dict:
                with torch.no_grad():
                    self.bias.copy_(state_dict[prefix + "bias"])
            else:
                missing_keys.append(prefix + "bias")

    def extra_repr(self) -> str:
        double = ", double_quant" if self.held_as.double_quant else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4{double}, compute={COMPUTE_DTYPE}"


def quantise_adapted_bases(net: nn.Module) -> int:
    """Swap the ``nn.Linear`` each LoRA layer of ``net`` wraps for an ``NF4Linear`` of its weights, when ``net``
    was built with ``model.lora.base_dtype=nf4`` (the count swapped; 0 for any other network). ``net``: the
    model itself, or a DDP wrapper of it."""
    inner = getattr(net, "module", net)
    held_as = getattr(inner, QUANTISE_BASE, None)
    if held_as is None:
        return 0
    require_bitsandbytes()
    swapped = 0
    for module in inner.modules():
        base = getattr(module, "base_layer", None)
        if hasattr(module, "lora_A") and type(base) is nn.Linear:
            module.base_layer = NF4Linear(base, held_as)
            swapped += 1
    return swapped


def nf4_layers(net: nn.Module) -> list[tuple[str, NF4Linear]]:
    """The nf4 base layers of ``net`` with their names."""
    return [(name, module) for name, module in net.named_modules() if isinstance(module, NF4Linear)]

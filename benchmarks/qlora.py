"""LoRA on a bf16 base against QLoRA's nf4 base (``model.lora.base_dtype``), side by side in one process.

    python benchmarks/qlora.py [--device cpu|cuda] [--steps 10] [--windows 3] [--threads 2]

Builds one Hugging Face Llama (random weights, no download), adds rank-16 adapters on its seven projections through
``disttrain.models.lora.add_adapters``, and holds the frozen base as each setting does: ``bfloat16`` (every frozen
weight in bf16), ``nf4`` (the adapted projections quantised by ``disttrain.models.nf4``, the rest as built) and
``nf4`` with ``double_quant`` (the blocks' scales quantised again to 8 bits).
Each trains AdamW steps under bf16 autocast on random tokens after two warm-up steps; tokens/s is the median of
``--windows`` windows of ``--steps`` steps. The table gives
the bytes of the adapted projections' weights and of all parameters (tensor bytes, measured), peak memory
allocated over the steps (CUDA only) and tokens/s; the last lines are nf4's projection bytes and tokens/s over bf16's,
and the bits each projection weight holds, plain nf4 against double-quantised.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import cpu_model  # noqa: E402

from disttrain.models.lora import LoRAConfig, add_adapters, lora_layers  # noqa: E402
from disttrain.models.nf4 import NF4Linear, quantise_adapted_bases  # noqa: E402
from disttrain.quiet_imports import quiet_imports  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIZES = {"cpu": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=2048, seq=128, batch=4),
         "cuda": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=8, vocab_size=32000, seq=1024, batch=4)}
"""Per device: the Llama's sizes (the CUDA one about 1.1B parameters, TinyLlama's shape) and the batch."""
BASES = {"bfloat16": ("bfloat16", False), "nf4": ("nf4", False), "nf4 double_quant": ("nf4", True)}
"""Table row -> the ``model.lora`` base_dtype and double_quant it holds the base as."""


def build(base_dtype: str, double_quant: bool, sizes: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The Llama with adapters, its frozen base held as ``base_dtype`` and ``double_quant`` say, on ``device``."""
    with quiet_imports():
        from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in sizes.items() if k not in ("seq", "batch")},
                         max_position_embeddings=sizes["seq"], use_cache=False)
    torch.manual_seed(seed)
    net = LlamaForCausalLM(config)
    lora = LoRAConfig(rank=16, alpha=32, target_modules=TARGETS, base_dtype=base_dtype, double_quant=double_quant)
    net = add_adapters(net, lora).to(device)
    quantise_adapted_bases(net)  # nothing unless base_dtype=nf4
    return net


def projection_weights(net: torch.nn.Module) -> int:
    """Weights of the adapted projections' base layers."""
    bases = [layer.get_base_layer() for _, layer in lora_layers(net)]
    return sum(base.weights if isinstance(base, NF4Linear) else base.weight.numel() for base in bases)


def projection_bytes(net: torch.nn.Module) -> int:
    """Bytes held by the adapted projections' base weights (nf4: codes and block scales)."""
    total = 0
    for _, layer in lora_layers(net):
        base = layer.get_base_layer()
        total += base.held_bytes() if isinstance(base, NF4Linear) else base.weight.nbytes
    return total


def train(net: torch.nn.Module, sizes: dict, device: torch.device, steps: int, windows: int
          ) -> tuple[float, float | None]:
    """The median tokens/s of ``windows`` windows of ``steps`` AdamW steps each, after two warm-up steps, and the
    peak bytes allocated over them (CUDA)."""
    params = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    tokens = torch.randint(0, sizes["vocab_size"], (sizes["batch"], sizes["seq"]), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = net(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    speeds = []
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        speeds.append(steps * tokens.numel() / (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return sorted(speeds)[len(speeds) // 2], peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--windows", type=int, default=3, help="timed windows of --steps steps; the median counts")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = SIZES[args.device]
    gpu = f", GPU: {torch.cuda.get_device_name()}" if device.type == "cuda" else ""
    print(f"CPU: {cpu_model()}, {args.threads} threads{gpu}, torch {torch.__version__}; HF Llama "
          f"{sizes['num_hidden_layers']} x {sizes['hidden_size']}, batch {sizes['batch']} x {sizes['seq']}, "
          f"LoRA rank 16 on {len(TARGETS)} projections, median of {args.windows} x {args.steps} steps\n")
    print("| base | projections (MiB) | all parameters (MiB) | peak allocated (MiB) | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    rows = {}
    for row, (base_dtype, double_quant) in BASES.items():
        net = build(base_dtype, double_quant, copy.deepcopy(sizes), device)
        projections = projection_bytes(net)
        weights = projection_weights(net)
        held = sum(p.nbytes for p in net.parameters()) - sum(
            layer.get_base_layer().weight.nbytes - layer.get_base_layer().held_bytes()
            for _, layer in lora_layers(net) if isinstance(layer.get_base_layer(), NF4Linear))
        speed, peak = train(net, sizes, device, args.steps, args.windows)
        rows[row] = (projections, speed, weights)
        peak_text = f"{peak / 2**20:,.0f}" if peak is not None else "-"
        print(f"| {row} | {projections / 2**20:,.1f} | {held / 2**20:,.1f} | {peak_text} | {speed:,.0f} |")
        del net
        if device.type == "cuda":
            torch.cuda.empty_cache()
    (bf16_bytes, bf16_speed, _), (nf4_bytes, nf4_speed, weights) = rows["bfloat16"], rows["nf4"]
    double_bytes, double_speed, _ = rows["nf4 double_quant"]
    print(f"\nnf4 / bf16 base: projection bytes {nf4_bytes / bf16_bytes:.3f}x, tokens/s {nf4_speed / bf16_speed:.2f}x")
    print(f"nf4 double_quant / bf16 base: projection bytes {double_bytes / bf16_bytes:.3f}x, tokens/s "
          f"{double_speed / bf16_speed:.2f}x")
    print(f"bits per projection weight: nf4 {8 * nf4_bytes / weights:.3f}, double_quant "
          f"{8 * double_bytes / weights:.3f} ({8 * (nf4_bytes - double_bytes) / weights:.3f} saved)")


if __name__ == "__main__":
    main()

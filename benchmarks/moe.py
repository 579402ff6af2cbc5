"""Mixture of experts: throughput and all-to-all bytes under expert parallelism, and the MoE against its dense twin.

    python benchmarks/moe.py [--steps 40] [--ranks 4] [--compare-steps 300]

Part 1: ``model=moe`` (the nano Llama with 8 experts, 2 per token) under ``parallel=zero3`` on ``--ranks`` gloo
ranks (one thread each) at ep 1, 2 and 4, ``--steps`` optimiser steps each (global batch 32 x 64 tokens, fp32).
Tokens/s come from each run's ``results.json`` (the steps after the first); bytes are what rank 0's expert
exchanges sent to other ranks per step (``experts.all_to_all_bytes_per_step``, counted at every all-to-all call),
against the ring model of all-to-all traffic: per layer and micro-batch, forward sends the rows bound for other
ranks' experts and returns the rows other ranks sent here, backward does both again with the gradients, so
``2 x (rows_out + rows_in) x n_embd x 4`` bytes, where with balanced routing ``rows_out = rows_in = R (ep-1)/ep``
(``R``: this rank's tokens x top_k). The load-aware model takes each layer's measured share of assignments that
rank 0's experts received (``experts.tokens_per_expert``) instead of ``1/ep``.

Part 2: the recipe's comparison (``recipe=moe_pydocs``) shortened to ``--compare-steps``: the MoE and the dense
nano Llama whose feed-forward width equals the two active experts' (the same parameters per token), on the same
tokens, both on 2 ranks (ZeRO-3; the MoE with ep=2): validation bits per byte and tokens/s.

The last line is the headline: measured / load-aware model bytes at the largest ep.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model=moe", "model.flavour=nano", "model.n_experts=8", "model.top_k=2", "data=pydocs",
         "data.block_size=64"]
N_EMBD, N_LAYER, BLOCK, TOP_K, EXPERTS = 128, 4, 64, 2, 8


def train(overrides: list[str], run_dir: Path) -> dict:
    """``train.py`` with ``overrides``; its results.json."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, "logger=none", "callbacks=none",
                           "trainer.run_test=false", f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((run_dir / "results.json").read_text())


def modelled_bytes(ep: int, tokens_per_rank: int, shares: list[float]) -> float:
    """Ring-model bytes per step of one rank's exchanges, its experts receiving ``shares`` of each layer's
    assignments (``1/ep`` each when balanced)."""
    rows = tokens_per_rank * TOP_K
    total = 0.0
    for share in shares:
        rows_out = rows * (1 - share)  # its rows bound for other ranks' experts
        rows_in = rows * (ep - 1) * share  # the other ranks' rows bound for its experts (as many tokens each)
        total += 2 * (rows_out + rows_in) * N_EMBD * 4
    return total


def parameter_counts(name: str) -> tuple[int, int]:
    """Parameters of the recipe's MoE or dense model (pydocs' byte vocabulary), and those one token uses."""
    import torch

    sys.path.insert(0, str(ROOT))
    from disttrain.data.spec import DataSpec
    from disttrain.models.llama import LlamaConfig, build_llama
    from disttrain.models.moe import MoEConfig, build_moe

    spec = DataSpec("text", vocab_size=256, block_size=BLOCK)
    with torch.device("meta"):
        if name == "dense":
            net = build_llama(LlamaConfig(flavour="nano"), spec)
            return net.num_params(non_embedding=False), net.num_params(non_embedding=False)
        net = build_moe(MoEConfig(flavour="nano", n_experts=EXPERTS, top_k=TOP_K), spec)
        return net.num_params(non_embedding=False), net.active_params(non_embedding=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--compare-steps", type=int, default=300)
    args = parser.parse_args()
    batch = 32
    tokens_per_rank = batch // args.ranks * BLOCK
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ep in (1, 2, 4):
            if ep > args.ranks:
                continue
            result = train([*MODEL, "parallel=zero3", f"parallel.ep={ep}", f"trainer.devices={args.ranks}",
                            f"batch.global_size={batch}", f"trainer.max_steps={args.steps}",
                            "trainer.limit_val_batches=0"], Path(tmp) / f"ep{ep}")
            experts = result["experts"]
            local = EXPERTS // ep
            shares = [sum(layer[:local]) / sum(layer) for layer in experts["tokens_per_expert"]]
            rows.append((ep, result["tokens_per_sec"], experts["all_to_all_bytes_per_step"],
                         modelled_bytes(ep, tokens_per_rank, [1 / ep] * N_LAYER),
                         modelled_bytes(ep, tokens_per_rank, shares)))
        compare = {}
        for name, extra in (("moe", ["parallel.ep=2"]), ("dense", ["model=llama", "parallel.ep=1"])):
            result = train(["recipe=moe_pydocs", *extra, f"trainer.max_steps={args.compare_steps}",
                            f"trainer.val_check_interval={args.compare_steps}"], Path(tmp) / name)
            compare[name] = result
    print(f"CPU: {cpu_model()}; model=moe nano (4 layers, width 128, 8 experts, top 2), zero3 on {args.ranks} "
          f"gloo ranks, batch {batch} x {BLOCK} tokens, fp32, {args.steps} steps\n")
    print("| ep | tokens/s | all-to-all bytes/step (rank 0) | balanced model | load-aware model | measured / model |")
    print("|---|---|---|---|---|---|")
    for ep, speed, sent, balanced, aware in rows:
        ratio = f"{sent / aware:.3f}" if aware else "-"
        print(f"| {ep} | {speed:,.0f} | {sent:,.0f} | {balanced:,.0f} | {aware:,.0f} | {ratio} |")
    print(f"\nrecipe=moe_pydocs shortened to {args.compare_steps} steps, 2 ranks, the same tokens:\n")
    print("| model | parameters | active per token | val/bpb | tokens/s | expert load max/mean (last step) |")
    print("|---|---|---|---|---|---|")
    for name, result in compare.items():
        total, active = parameter_counts(name)
        balance = result.get("experts", {}).get("last_step", {}).get("load_max_over_mean")
        print(f"| {name} | {total:,} | {active:,} | {result['metrics']['val/bpb']:.4f} | "
              f"{result['tokens_per_sec']:,.0f} | {f'{balance:.2f}' if balance else '-'} |")
    ep, _, sent, _, aware = rows[-1]
    print(f"\nall-to-all bytes at ep={ep}: measured / ring model {sent / aware:.3f}")


if __name__ == "__main__":
    main()

"""The mixture loader's tokens/s with 1 and 2 workers against the tokens/s a GPT-2 124M training step consumes.

Python's documentation dealt into three sources (Parquet, JSON lines, text files; ``disttrain.data.pydocs_sources``)
and a byte-level BPE tokenizer trained on it, mixed with weights 2:1:1 into windows of ``--block-size`` tokens. The
sources' length index is built first (once, as the job does before ranks start; its time is printed). Then one
rank's DataLoader with 1 and 2 worker processes reads, tokenises and packs the stream, and one worker of rank 0 of 2
ranks; each worker places every document from the lengths and tokenises only the documents of its own windows,
which is counted per worker against the documents of the stretch of stream read (a count, the same on every
machine). Against it: the tokens/s of a GPT-2 124M step (AdamW, fp32, batch ``--cpu-batch`` x 1024) measured here on
the CPU, and ``--gpu-tokens-per-s`` (a GPT-2 124M step on one GPU, measured before on an H100-class GPU). Also the
packing efficiency: the share of window tokens that are document tokens (the rest are end-of-document tokens;
packing pads nothing).

    python benchmarks/data_throughput.py [--block-size 1024] [--micro 8] [--batches 32] [--cpu-batch 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402

from disttrain.data import MixtureConfig, MixtureSource  # noqa: E402
from disttrain.data.mixture_layout import MixturePlan, StreamLayout  # noqa: E402
from disttrain.data.mixture_stream import DocumentTokens, MixtureWindows, RankShare, StreamState  # noqa: E402
from disttrain.data.pydocs_sources import split_topics, write_pydocs_sources  # noqa: E402

CORPORA = {"whole topics": 0, "topics cut into ~2,000-character documents": 2000}
"""The two shapes of the sources: Python's topics as they are (a few of tens of thousands of characters hold most
tokens), and cut at paragraph ends into documents of about 2,000 characters (a web page's usual size)."""


def write_sources(folder: str, document_chars: int) -> dict[str, Path]:
    """The three sources and the tokenizer under ``folder``; with ``document_chars``, each topic cut at paragraph
    ends into documents of at least that many characters (its last may be shorter)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = write_pydocs_sources(folder)
    if not document_chars:
        return paths
    cut = {name: [document for topic in topics for document in cut_topic(topic, document_chars)]
           for name, topics in split_topics().items()}
    pq.write_table(pa.table({"text": cut["reference"]}), paths["reference"], row_group_size=64)
    paths["library"].write_text("".join(json.dumps({"text": text}) + "\n" for text in cut["library"]),
                                encoding="utf-8")
    for old in paths["other"].glob("*.txt"):
        old.unlink()
    for number, text in enumerate(cut["other"]):
        (paths["other"] / f"{number:05d}.txt").write_text(text, encoding="utf-8")
    return paths


def cut_topic(text: str, chars: int) -> list[str]:
    """``text`` cut after the paragraph that brings a piece to ``chars`` characters."""
    pieces, current = [], ""
    for paragraph in text.split("\n\n"):
        current = f"{current}\n\n{paragraph}" if current else paragraph
        if len(current) >= chars:
            pieces.append(current)
            current = ""
    return [*pieces, current] if current else pieces


def loader_rate(plan: MixturePlan, micro: int, batches: int, workers: int,
                replicas: int = 1) -> tuple[float, float, float]:
    """Tokens/s rank 0 of ``replicas`` receives from a DataLoader of ``workers`` processes (their start included);
    the tokens it receives per CPU-second of its own process and its workers (what the rate would be with a core
    each, however loaded the machine); and the share of its window tokens that are document tokens."""
    share = RankShare(micro, 1, replicas, 0, 0, batches)
    loader = DataLoader(MixtureWindows(plan, StreamState.start(len(plan.sources)), share), batch_size=None,
                        num_workers=workers)
    started, cpu, tokens, ends = time.perf_counter(), cpu_seconds(), 0, 0
    for inputs, _, _ in loader:
        tokens += inputs.numel()
        ends += int((inputs == plan.eos_id).sum())
    del loader  # its workers are joined: their CPU time is counted
    return tokens / (time.perf_counter() - started), tokens / (cpu_seconds() - cpu), 1 - ends / tokens


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (user and system)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def documents_tokenised(plan: MixturePlan, micro: int, batches: int, workers: int,
                        replicas: int) -> list[tuple[int, float]]:
    """For each loader worker of rank 0, in an epoch of ``batches`` micro-batches per rank: the documents it
    tokenises, and the tokens it tokenises per window token it delivers."""
    share = RankShare(micro, 1, replicas, 0, 0, batches)
    windows, counts = MixtureWindows(plan, StreamState.start(len(plan.sources)), share), []
    for worker in range(workers):
        tokens, delivered = DocumentTokens(plan), 0
        for inputs, _, _ in windows.batches(worker, workers, tokens):
            delivered += inputs.numel()
        counts.append((tokens.tokenised, tokens.tokenised_tokens / delivered))
    return counts


def stream_documents(plan: MixturePlan, windows: int) -> int:
    """Documents with a token in the stream's first ``windows`` windows."""
    layout = StreamLayout(plan, StreamState.start(len(plan.sources)))
    layout.move_to(windows)
    return sum(layout.state.documents)


def gpt2_cpu_rate(batch: int, steps: int = 2) -> float:
    """Tokens/s of a GPT-2 124M training step (forward, backward, AdamW) in fp32 on this CPU."""
    from disttrain.data.spec import DataSpec
    from disttrain.models import build_model
    from disttrain.models.gpt import GPTConfig

    model = build_model(GPTConfig(flavour="gpt2"), DataSpec(kind="text", vocab_size=50304, block_size=1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 50257, (batch, 1025))
    times = []
    for _ in range(steps + 1):  # the first step allocates the optimiser's state: not timed
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return batch * 1024 / float(np.median(times[1:]))


def main() -> None:
    """Measure and print the tables and the headline."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8, help="windows per micro-batch")
    parser.add_argument("--batches", type=int, default=32, help="micro-batches each measurement reads")
    parser.add_argument("--cpu-batch", type=int, default=1, help="sequences of 1024 in the CPU's GPT-2 step")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=450_000.0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the loader measurements; the best counts")
    args = parser.parse_args()
    torch.manual_seed(0)
    measured = {name: measure(chars, args) for name, chars in CORPORA.items()}
    cpu = gpt2_cpu_rate(args.cpu_batch)
    gpu = args.gpu_tokens_per_s
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; block {args.block_size}, "
          f"micro-batch {args.micro}, {args.batches} micro-batches per rank and measurement, best of "
          f"{args.repeats}\n")
    print("| sources | length index, built once | tokens per document, mean |")
    print("|---|---:|---:|")
    for name, found in measured.items():
        print(f"| {name} | {found['documents']:,} documents, {found['tokens']:,} tokens in {found['built']:.2f} s "
              f"({found['tokens'] / found['built']:,.0f} tokens/s) | {found['tokens'] / found['documents']:,.0f} |")
    print("\n| sources | loader | tokens/s | per worker | / 1 rank, 1 worker | tokens per CPU-second of the loader's "
          "processes |")
    print("|---|---|---:|---:|---:|---:|")
    for name, found in measured.items():
        one = found["rates"][(1, 1)]
        for (replicas, workers), rate in found["rates"].items():
            print(f"| {name} | rank 0 of {replicas}, {workers} worker(s) | {rate:,.0f} | {rate / workers:,.0f} | "
                  f"{rate / one:.2f} | {found['per_cpu'][(replicas, workers)]:,.0f} |")
    print("\n| sources | ranks x workers | documents each worker of rank 0 tokenises | documents of the stream "
          "read | largest share | tokens tokenised per token delivered (every worker reading the stream: ranks x "
          "workers) |")
    print("|---|---|---:|---:|---:|---:|")
    for name, found in measured.items():
        for (replicas, workers), tokenised in found["counts"].items():
            span = found["spans"][replicas]
            documents = [count for count, _ in tokenised]
            print(f"| {name} | {replicas} x {workers} | {', '.join(f'{count:,}' for count in documents)} | {span:,} "
                  f"| {max(documents) / span:.2f} | {max(ratio for _, ratio in tokenised):.2f} "
                  f"({replicas * workers}) |")
    whole = measured[next(iter(CORPORA))]
    print(f"\nGPT-2 124M step, fp32, this CPU (batch {args.cpu_batch} x 1024): {cpu:,.0f} tokens/s; one GPU (given): "
          f"{gpu:,.0f} tokens/s")
    print(f"packing efficiency: {whole['packing']:.2%} of window tokens are document tokens (the rest end "
          "documents; no padding)")
    cut = measured[list(CORPORA)[1]]
    one, two = cut["rates"][(1, 1)], cut["rates"][(1, 2)]
    per_cpu = cut["per_cpu"][(2, 2)]
    share = max(count for count, _ in cut["counts"][(2, 2)]) / cut["spans"][2]
    whole_share = max(count for count, _ in whole["counts"][(2, 2)]) / whole["spans"][2]
    print(f"headline: cut documents, on 2 ranks x 2 workers each worker tokenises {share:.2f} of the stream's "
          f"documents (whole topics: {whole_share:.2f}), where every worker tokenised all of them before; a rank's "
          f"loader gives {per_cpu:,.0f} tokens per CPU-second ({per_cpu / gpu:.2f}x a GPT-2 124M step on one GPU, "
          f"{per_cpu / cpu:,.0f}x one on this CPU); on these shared cores 2 workers gave {two / one:.2f}x the wall "
          "tokens/s of 1")


def measure(document_chars: int, args: argparse.Namespace) -> dict:
    """The index's build time and size, the loader's rates, each worker's documents tokenised and the stream's
    documents, for the sources cut at ``document_chars`` (0: whole topics)."""
    micro, batches = args.micro, args.batches
    with tempfile.TemporaryDirectory() as folder:
        paths = write_sources(folder, document_chars)
        cfg = MixtureConfig(sources=[MixtureSource(str(paths["reference"]), 2.0),
                                     MixtureSource(str(paths["library"]), 1.0),
                                     MixtureSource(str(paths["other"] / "*.txt"), 1.0)],
                            tokenizer=str(paths["tokenizer"]), block_size=args.block_size, val_documents=2)
        started = time.perf_counter()
        plan = cfg.plan(seed=0)
        built = time.perf_counter() - started
        layouts = ((1, 1), (1, 2), (2, 1), (2, 2))
        rounds = [{(replicas, workers): loader_rate(plan, micro, batches, workers, replicas)
                   for replicas, workers in layouts} for _ in range(args.repeats)]  # interleaved: the load is shared
        return {"built": built, "tokens": sum(source.num_tokens for source in plan.sources),
                "documents": sum(source.num_documents for source in plan.sources),
                "rates": {layout: max(found[layout][0] for found in rounds) for layout in layouts},
                "per_cpu": {layout: max(found[layout][1] for found in rounds) for layout in layouts},
                "packing": rounds[0][(1, 1)][2],
                "counts": {(replicas, workers): documents_tokenised(plan, micro, batches, workers, replicas)
                           for replicas, workers in layouts},
                "spans": {replicas: stream_documents(plan, batches * micro * replicas) for replicas in (1, 2)}}


if __name__ == "__main__":
    main()

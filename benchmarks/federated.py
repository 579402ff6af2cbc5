"""Federated learning on the digits CNN: accuracy per round by partition and strategy, bytes and time per round;
robust aggregation under attack, asynchronous against synchronous aggregation, and many clients.

    python benchmarks/federated.py                  # every table: about 15 minutes on 2 cores
    python benchmarks/federated.py --seeds 1 --rounds 10
    python benchmarks/federated.py --tables robust,async,scale

Part 1 runs the rounds in this process (the same ``FederatedRounds`` the runner uses, world size 1: the
aggregate does not depend on how clients are spread over ranks) for iid, Dirichlet 0.5 and Dirichlet 0.1
partitions of 20 clients, 5 drawn per round, 10 local steps of batch 32 with AdamW at lr 1e-3, under
fedavg, fedprox (mu 0.01 and 0.1) and fedadam (server lr 0.01); the global model's test accuracy after
rounds 10, 20 and 30, mean and spread over seeds. Part 2 times whole runs (``train.py parallel=federated``,
2 ranks) with 20 and 100 clients. Writes ``federated.png`` and prints markdown tables.

``robust``: 20 Dirichlet(0.5) clients, all drawn each round, 4 of them hostile; the test accuracy after 30
rounds of each aggregation rule under each attack (a small BatchNorm-free CNN, SGD lr 0.1 momentum 0.9, 5
local steps). ``async``: 20 iid clients, 10 training at once, a fifth of them 10x slower; simulated time at
which synchronous FedAvg and FedBuff (K = 5 and 2) first reach each accuracy. ``scale``: 100 to 10,000
clients, 100 per round, on 2 gloo ranks: each rank's peak RSS and the wall time of a round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402

from disttrain.data.digits import DigitsConfig, ImageDataset, digits_split  # noqa: E402
from disttrain.federated.buffered import BufferedRounds  # noqa: E402
from disttrain.federated.client import evaluate  # noqa: E402
from disttrain.federated.config import AttackConfig, FederatedConfig  # noqa: E402
from disttrain.federated.partition import labels_of, partition  # noqa: E402
from disttrain.federated.rounds import FederatedRounds  # noqa: E402
from disttrain.federated.server import RULES, ServerOptimizer  # noqa: E402
from disttrain.models import build_model  # noqa: E402
from disttrain.models.cnn import CNNConfig  # noqa: E402
from disttrain.optim.torch_optims import AdamWConfig, SGDConfig  # noqa: E402
from disttrain.parallel.process_group import free_port  # noqa: E402

PARTITIONS = {"iid": ("iid", 0.0), "dirichlet 0.5": ("dirichlet", 0.5), "dirichlet 0.1": ("dirichlet", 0.1)}
STRATEGIES = {"fedavg": ("fedavg", 0.0), "fedprox mu=0.01": ("fedprox", 0.01), "fedprox mu=0.1": ("fedprox", 0.1),
              "fedadam": ("fedadam", 0.0)}


def accuracy_curve(scheme: str, alpha: float, strategy: str, mu: float, seed: int, rounds: int, splits) -> list[float]:
    """Test accuracy of the global model after every 10th round."""
    from disttrain.data.spec import DataSpec

    torch.manual_seed(seed)
    train_set, test_set = ImageDataset(*splits["train"]), ImageDataset(*splits["test"])
    net = build_model(CNNConfig(), DataSpec(kind="image", num_classes=10, in_channels=1, image_size=8))
    fed = FederatedConfig(clients=20, clients_per_round=5, rounds=rounds, local_steps=10, batch_size=32,
                          strategy=strategy, mu=mu, partition=scheme, alpha=alpha or 0.5)
    parts = partition(len(train_set), fed.clients, scheme, seed, labels_of(train_set), fed.alpha)
    runner = FederatedRounds(net, train_set, parts, fed, AdamWConfig(), 1.0, seed, None, torch.device("cpu"))
    params = [p for p in net.parameters() if p.requires_grad]
    server = ServerOptimizer(params, RULES[strategy], fed.server.resolved_lr(strategy))
    test_batches = [(test_set.images[i:i + 256], test_set.labels[i:i + 256]) for i in range(0, len(test_set), 256)]
    curve = []
    for r in range(rounds):
        update, _ = runner.run(r)
        runner.apply(update, server)
        server.step()
        if (r + 1) % 10 == 0:
            correct, _, count = evaluate(net, test_batches, torch.device("cpu"))
            curve.append(correct / count)
    return curve


def timed_run(clients: int, rounds: int) -> dict:
    """A whole ``train.py`` run on 2 ranks with ``clients`` clients, 5 per round: its results.json."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, str(ROOT / "train.py"), "parallel=federated", "trainer.devices=2",
                   f"federated.clients={clients}", f"federated.rounds={rounds}", "logger=csv", "callbacks=none",
                   "trainer.run_test=false", f"trainer.val_check_interval={rounds}", f"hydra.run.dir={tmp}/run"]
        subprocess.run(command, check=True, capture_output=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
        return json.loads((Path(tmp) / "run" / "results.json").read_text())


def small_cnn() -> nn.Module:
    """The BatchNorm-free CNN of the robust and async tables (13k parameters)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1, stride=2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16, 10))


def curve_of(fed: FederatedConfig, scheme: str, splits, steps: int, lr: float) -> list[tuple[float, float]]:
    """(simulated time, test accuracy) after every server step of ``fed`` on digits (one process), the clients
    training with SGD at ``lr``, momentum 0.9."""
    train_set, test_set = ImageDataset(*splits["train"]), ImageDataset(*splits["test"])
    net = small_cnn()
    parts = partition(len(train_set), fed.clients, scheme, 0, labels_of(train_set), fed.alpha)
    runner = FederatedRounds(net, train_set, parts, fed, SGDConfig(lr=lr, momentum=0.9), 1.0, 0, None,
                             torch.device("cpu"))
    if fed.mode == "async":
        runner = BufferedRounds(runner)
    server = ServerOptimizer(list(net.parameters()), "avg", 1.0)
    curve = []
    for step in range(steps):
        update, stats = runner.run(step)
        runner.apply(update, server)
        server.step()
        correct, _, count = evaluate(net, [(test_set.images, test_set.labels)], torch.device("cpu"))
        curve.append((stats.sim_time, correct / count))
    return curve


def robust_table(splits) -> None:
    """Test accuracy after 30 rounds of each rule under each attack."""
    attacks = {"none": AttackConfig(), "sign_flip x10": AttackConfig("sign_flip", 0.2, 10.0),
               "scale x10": AttackConfig("scale", 0.2, 10.0), "random x10": AttackConfig("random", 0.2, 10.0),
               "label_flip": AttackConfig("label_flip", 0.2)}
    rules = ("mean", "median", "trimmed_mean", "krum", "multi_krum")
    print("\n20 Dirichlet(0.5) digits clients, all drawn each round, 4 hostile; test accuracy after 30 rounds "
          "(trim_fraction 0.2, assumed_attackers 4)\n")
    print("| attack | " + " | ".join(rules) + " |")
    print("|---|" + "---|" * len(rules))
    for label, hostility in attacks.items():
        cells = []
        for rule in rules:
            fed = FederatedConfig(clients=20, clients_per_round=0, rounds=30, local_steps=5, batch_size=32,
                                  partition="dirichlet", alpha=0.5, aggregation=rule, assumed_attackers=4,
                                  trim_fraction=0.2, attack=hostility)
            fed.validate()
            cells.append(f"{curve_of(fed, 'dirichlet', splits, 30, 0.1)[-1][1]:.3f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def async_table(splits) -> None:
    """Simulated time to each accuracy: synchronous FedAvg against FedBuff under the same client speeds."""
    targets = (0.80, 0.85, 0.90, 0.92)
    runs = {"sync FedAvg (10 per round)": ("sync", 0, 10), "FedBuff K=5 (10 at once)": ("async", 5, 40),
            "FedBuff K=2 (10 at once)": ("async", 2, 100)}
    print("\n20 iid digits clients, a fifth of them 10x slower (latency spread 0.25); simulated time (units of a "
          "fast client's local training) at which the test accuracy first reaches each level\n")
    print("| run | steps | " + " | ".join(f"t @ {t:.2f}" for t in targets) + " | final acc | final t |")
    print("|---|---|" + "---|" * (len(targets) + 2))
    for label, (mode, buffer, steps) in runs.items():
        fed = FederatedConfig(clients=20, clients_per_round=10, rounds=steps, local_steps=5, batch_size=32,
                              mode=mode, buffer_size=buffer, slow_fraction=0.2, slowdown=10.0)
        fed.validate()
        curve = curve_of(fed, "iid", splits, steps, 0.05)
        reached = [next((f"{t:.1f}" for t, acc in curve if acc >= target), "-") for target in targets]
        print(f"| {label} | {steps} | " + " | ".join(reached) + f" | {curve[-1][1]:.3f} | {curve[-1][0]:.1f} |",
              flush=True)


def _rss_mib() -> float:
    """This process's resident memory now (Linux; the peak so far elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _scale_rank(rank: int, port: int, clients: int, results) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(0)
    samples = 20_000
    dataset = ImageDataset(torch.randn(samples, 1, 8, 8, generator=generator),
                           torch.randint(0, 10, (samples,), generator=generator))
    before = _rss_mib()
    fed = FederatedConfig(clients=clients, clients_per_round=100, local_steps=2, batch_size=8, eval_batches=1)
    fed.validate()
    net = small_cnn()
    runner = FederatedRounds(net, dataset, partition(samples, clients, "iid", 0), fed,
                             SGDConfig(lr=0.05, momentum=0.0), None, 0, dist.group.WORLD, torch.device("cpu"))
    server = ServerOptimizer(list(net.parameters()), "avg", 1.0)
    runner.run(0)  # warm-up round, not timed
    started = time.perf_counter()
    for r in range(1, 6):
        update, _ = runner.run(r)
        runner.apply(update, server)
        server.step()
    results.put((rank, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, _rss_mib() - before,
                 (time.perf_counter() - started) / 5))
    dist.destroy_process_group()


def scale_table() -> None:
    """Peak RSS and round time with 100 to 10,000 clients, 100 per round, on 2 ranks."""
    print("\n100 clients per round on 2 gloo ranks (2 local steps of batch 8, 13k-parameter CNN, 20,000 samples): "
          "peak RSS of each rank, what building the clients and running the rounds added to its resident "
          "memory, and wall time per round (mean of 5 after a warm-up)\n")
    print("| clients | peak RSS MiB (rank 0, 1) | RSS added by the run MiB (rank 0, 1) | s per round |")
    print("|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for clients in (100, 1_000, 10_000):
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_scale_rank, args=(rank, port, clients, results)) for rank in range(2)]
        for proc in procs:
            proc.start()
        rows = sorted(results.get(timeout=600) for _ in procs)
        for proc in procs:
            proc.join()
        print(f"| {clients:,} | {rows[0][1]:.1f}, {rows[1][1]:.1f} | {rows[0][2]:.1f}, {rows[1][2]:.1f} | "
              f"{max(r[3] for r in rows):.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--plot", default="federated.png")
    parser.add_argument("--tables", default="accuracy,robust,async,scale",
                        help="comma-separated: accuracy (partitions x strategies, timed runs), robust, async, scale")
    args = parser.parse_args()
    torch.set_num_threads(1)
    splits = digits_split(DigitsConfig())
    tables = set(args.tables.split(","))
    if tables - {"accuracy"}:
        print(f"CPU: {cpu_model()}; torch {torch.__version__}")
    if "robust" in tables:
        robust_table(splits)
    if "async" in tables:
        async_table(splits)
    if "scale" in tables:
        scale_table()
    if "accuracy" in tables:
        accuracy_tables(args, splits)


def accuracy_tables(args: argparse.Namespace, splits) -> None:
    """The partitions x strategies table, the timed whole runs and the plot."""
    checkpoints = list(range(10, args.rounds + 1, 10))
    print(f"\nCPU: {cpu_model()}; torch {torch.__version__}; digits CNN, 20 clients, 5 per round, 10 local steps of "
          f"batch 32, AdamW lr 1e-3; {args.seeds} seed(s)\n")
    print("| partition | strategy | " + " | ".join(f"test acc @ {c}" for c in checkpoints) + " |")
    print("|---|---|" + "---|" * len(checkpoints))
    curves: dict[tuple[str, str], list[float]] = {}
    for label, (scheme, alpha) in PARTITIONS.items():
        for name, (strategy, mu) in STRATEGIES.items():
            runs = [accuracy_curve(scheme, alpha, strategy, mu, seed, args.rounds, splits)
                    for seed in range(args.seeds)]
            means = [statistics.mean(col) for col in zip(*runs, strict=True)]
            spreads = [statistics.pstdev(col) for col in zip(*runs, strict=True)]
            curves[(label, name)] = means
            cells = " | ".join(f"{m:.4f} ± {s:.4f}" for m, s in zip(means, spreads, strict=True))
            print(f"| {label} | {name} | {cells} |", flush=True)
    print("\n| clients | clients per round | bytes up per round | bytes down per round | wall s per round | "
          "client samples/s |")
    print("|---|---|---|---|---|---|")
    for clients in (20, 100):
        results = timed_run(clients, 10)
        fed = results["federated"]
        print(f"| {clients} | {fed['clients_per_round']} | {fed['bytes_up_per_round']:,} | "
              f"{fed['bytes_down_per_round']:,} | {results['wall_time_s'] / fed['rounds']:.3f} | "
              f"{fed['client_samples_per_sec']:.0f} |", flush=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, len(PARTITIONS), figsize=(12, 3.5), sharey=True)
        for axis, label in zip(axes, PARTITIONS, strict=True):
            for name in STRATEGIES:
                axis.plot(checkpoints, curves[(label, name)], marker="o", label=name)
            axis.set_title(label)
            axis.set_xlabel("round")
        axes[0].set_ylabel("test accuracy")
        axes[-1].legend()
        figure.savefig(args.plot, dpi=110, bbox_inches="tight")
        print(f"\nplot: {args.plot}")
    except ImportError:
        print("\n(matplotlib not installed: no plot)")
    last = {key: curve[-1] for key, curve in curves.items()}
    best_prox = max(last[("dirichlet 0.1", n)] for n in STRATEGIES if n.startswith("fedprox"))
    print(f"\nheadline: after {args.rounds} rounds iid fedavg {last[('iid', 'fedavg')]:.4f}; Dirichlet 0.1: fedavg "
          f"{last[('dirichlet 0.1', 'fedavg')]:.4f}, best fedprox {best_prox:.4f}, fedadam "
          f"{last[('dirichlet 0.1', 'fedadam')]:.4f}")


if __name__ == "__main__":
    main()

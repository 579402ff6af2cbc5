"""Federated learning on the digits CNN: accuracy per round by partition and strategy, bytes and time per round.

    python benchmarks/federated.py                  # 3 seeds, 30 rounds: about 10 minutes on 2 cores
    python benchmarks/federated.py --seeds 1 --rounds 10

Part 1 runs the rounds in this process (the same ``FederatedRounds`` the runner uses, world size 1: the
aggregate does not depend on how clients are spread over ranks) for iid, Dirichlet 0.5 and Dirichlet 0.1
partitions of 20 clients, 5 drawn per round, 10 local steps of batch 32 with AdamW at lr 1e-3, under
fedavg, fedprox (mu 0.01 and 0.1) and fedadam (server lr 0.01); the global model's test accuracy after
rounds 10, 20 and 30, mean and spread over seeds. Part 2 times whole runs (``train.py parallel=federated``,
2 ranks) with 20 and 100 clients. Writes ``federated.png`` and prints markdown tables; the last line is the
headline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402

from disttrain.data.digits import DigitsConfig, ImageDataset, digits_split  # noqa: E402
from disttrain.federated.client import evaluate  # noqa: E402
from disttrain.federated.config import FederatedConfig  # noqa: E402
from disttrain.federated.partition import labels_of, partition  # noqa: E402
from disttrain.federated.rounds import FederatedRounds  # noqa: E402
from disttrain.federated.server import RULES, ServerOptimizer  # noqa: E402
from disttrain.models import build_model  # noqa: E402
from disttrain.models.cnn import CNNConfig  # noqa: E402
from disttrain.optim.torch_optims import AdamWConfig  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--plot", default="federated.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    splits = digits_split(DigitsConfig())
    checkpoints = list(range(10, args.rounds + 1, 10))
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; digits CNN, 20 clients, 5 per round, 10 local steps of "
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

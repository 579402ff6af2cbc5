"""What torchft 0.2 does on CPU (gloo) when a replica group dies, and what its quorum costs when none does.

    PYTHONPATH=DIR_WITH_TORCHFT python benchmarks/torchft_probe.py [--steps 30] [--kill-at 10] [--fault kill]

A standalone probe, not part of disttrain (``torchft`` is not one of its dependencies). The job process starts
a lighthouse (``torchft.coordination.LighthouseServer``) and ``--groups`` replica groups of one rank each, every
group a process with its own TCPStore and ``torchft.Manager`` over a ``ProcessGroupGloo``. Each trains the same
small MLP with AdamW for ``--steps`` committed steps, its gradients averaged over the groups of the current
quorum by ``Manager.allreduce`` (``--allreduce ddp``: through ``torchft.DistributedDataParallel`` instead).
When group ``--victim`` has committed ``--kill-at`` steps it is killed (``--fault kill``: SIGKILL; ``--fault
stop``: SIGSTOP, then SIGKILL after ``--stop-for-s`` seconds, as a watchdog would) and started again at once;
it rejoins at a later quorum and takes the weights and AdamW state from a live peer. Printed: per step, which
groups committed it (``H``: the group healed from a peer at that step), whether every group that committed a
step holds bitwise the same weights and optimiser state after it, the steps the survivors did not commit, how
long they stalled, and how long the victim took from the fault to its first committed step.

A second phase (``--overhead-steps``, 0 to skip; ``--fault none`` runs it alone) measures the cost when nothing
fails: the same training on the same groups through torchft (synchronous quorum, as a per-step data
assignment needs, and asynchronous) and through plain ``torch.distributed`` DDP on one gloo group, with the
median step time of each and the time spent in ``start_quorum`` and ``should_commit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

WIDTH = 256
"""Hidden width of the probe's MLP (``--width`` overrides it)."""
SAMPLES = 64
"""Samples per group and step."""


def build_model(width: int) -> torch.nn.Module:
    """The same MLP in every group (seeded), so only recovery can make groups differ."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                               torch.nn.GELU(), torch.nn.Linear(width, 1))


def batch(step: int, slot: int, size: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Group ``slot``'s samples of ``step``: a fixed linear teacher plus noise, drawn from a counter-seeded
    generator, so a repeated step reads the same samples."""
    gen = torch.Generator().manual_seed(1_000_003 * step + slot)
    x = torch.randn(size, 32, generator=gen)
    teacher = torch.linspace(-1.0, 1.0, 32)
    return x, (x @ teacher).unsqueeze(1) + 0.1 * torch.randn(size, 1, generator=gen)


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of every parameter and every optimiser state tensor, in order: equal digests are bitwise
    equal states."""
    sha = hashlib.sha256()
    for p in model.parameters():
        sha.update(p.detach().numpy().tobytes())
        for value in optimizer.state.get(p, {}).values():
            sha.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return sha.hexdigest()[:16]


# ---------------------------------------------------------------- replica group (one process)
def replica(args: argparse.Namespace) -> None:
    """One replica group of one rank: train ``args.steps`` committed steps under a torchft Manager, writing one
    JSON line per attempted step to ``args.log``."""
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = build_model(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    healed: list[int] = []

    def load_state(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        healed.append(1)

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout_s)), min_replica_size=args.min_groups,
        load_state_dict=load_state, state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"group{args.group}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=args.lighthouse, use_async_quorum=args.async_quorum,
        timeout=timedelta(seconds=args.timeout_s), quorum_timeout=timedelta(seconds=args.quorum_timeout_s),
        connect_timeout=timedelta(seconds=10),
    )
    params = list(model.parameters())
    # torchft's DistributedDataParallel ends a survivor's backward with an AssertionError when a peer dies
    # inside the all-reduce (its communication hook asserts on a future that the failed wait never set);
    # ``--allreduce ddp`` shows it. The Manager's own all-reduce reports the error and the step is not committed.
    net = DistributedDataParallel(manager, model) if args.allreduce == "ddp" else model
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - one line per step, flushed as written
    while manager.current_step() < args.steps:
        started = time.perf_counter()
        healed.clear()
        manager.start_quorum()
        optimizer.zero_grad()
        quorum_s = time.perf_counter() - started
        participants = manager.num_participants()  # waits for an asynchronous quorum
        step = manager.current_step()  # a group that heals takes its peers' step with their state
        x, y = batch(step, args.group)
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()  # under --allreduce ddp, the Manager's all-reduce runs in DDP's communication hook
        if args.allreduce == "manager":  # one all-reduce of every gradient, averaged over the participants
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        backward_done = time.perf_counter()
        committed = manager.should_commit()
        commit_s = time.perf_counter() - backward_done
        if committed:
            optimizer.step()
        if args.step_sleep_s:
            time.sleep(args.step_sleep_s)  # stands for a longer step's compute
        record = {"group": args.group, "attempt": args.attempt, "step": step, "committed": committed,
                  "step_after": manager.current_step(), "participants": participants, "healed": bool(healed),
                  "quorum_id": manager._quorum_id, "loss": loss.item(), "quorum_s": quorum_s,
                  "commit_s": commit_s, "step_s": time.perf_counter() - started, "wall": time.time(),
                  "digest": digest(model, optimizer) if committed else None}
        log.write(json.dumps(record) + "\n")
    log.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads outlive the interpreter's teardown otherwise


def baseline(args: argparse.Namespace) -> None:
    """The same training through plain DDP on a gloo group (no torchft): the reference step time."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.group, world_size=args.groups)
    model = build_model(args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    net = DistributedDataParallel(model)
    log = open(args.log, "a", buffering=1)  # noqa: SIM115
    for step in range(args.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        x, y = batch(step, args.group)
        torch.nn.functional.mse_loss(net(x), y).backward()
        optimizer.step()
        log.write(json.dumps({"group": args.group, "step": step, "step_s": time.perf_counter() - started}) + "\n")
    log.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the job process
def read_log(path: Path) -> list[dict]:
    """The JSON lines a group has written so far (a line cut by a SIGKILL is dropped)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def spawn(args: argparse.Namespace, role: str, group: int, log: Path, attempt: int = 0,
          extra_env: dict[str, str] | None = None, **overrides: object) -> subprocess.Popen:
    """Start a replica group (``role`` replica or baseline) as a new interpreter."""
    options = {**vars(args), **overrides}
    command = [sys.executable, __file__, "--role", role, "--group", str(group), "--attempt", str(attempt),
               "--log", str(log)]
    for key in ("steps", "groups", "min_groups", "width", "step_sleep_s", "pg_timeout_s", "timeout_s",
                "quorum_timeout_s", "lighthouse", "allreduce"):
        command += [f"--{key.replace('_', '-')}", str(options[key])]
    if options["async_quorum"]:
        command.append("--async-quorum")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error", **(extra_env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(f"{log}.err", "a"))  # noqa: SIM115


def wait_all(procs: list[subprocess.Popen], limit_s: float) -> None:
    """Wait for every process; kill those still running after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def lighthouse(args: argparse.Namespace):  # noqa: ANN201 - torchft's type, imported lazily
    """A lighthouse in this process, on a free port."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(bind="[::]:0", min_replicas=args.min_groups, join_timeout_ms=args.join_timeout_ms,
                            heartbeat_timeout_ms=args.heartbeat_timeout_ms)


def failure_phase(args: argparse.Namespace, folder: Path) -> dict:
    """Train with a fault injected into the victim group; the per-step table and the recovery figures."""
    server = lighthouse(args)
    args.lighthouse = server.address()
    logs = [folder / f"group{g}.jsonl" for g in range(args.groups)]
    procs = [spawn(args, "replica", g, logs[g]) for g in range(args.groups)]
    victim = procs[args.victim]
    fault_at = restart_at = None
    deadline = time.monotonic() + args.limit_s
    while fault_at is None and time.monotonic() < deadline:
        if sum(r["committed"] for r in read_log(logs[args.victim])) >= args.kill_at:
            if args.fault == "stop":
                victim.send_signal(signal.SIGSTOP)
                fault_at = time.time()
                time.sleep(args.stop_for_s)
            else:
                fault_at = time.time()
            victim.kill()
            victim.wait()
            restart_at = time.time()
            procs[args.victim] = spawn(args, "replica", args.victim, logs[args.victim], attempt=1)
        time.sleep(0.01)
    survivors = [proc for g, proc in enumerate(procs) if g != args.victim]
    wait_all(survivors, max(1.0, deadline - time.monotonic()))
    wait_all([procs[args.victim]], 15.0)  # a victim that has not rejoined by now waits for a quorum in vain
    server.shutdown()
    rows = [row for log in logs for row in read_log(log)]
    figures = summarise_failure(args, rows, fault_at, restart_at)
    figures["exit_codes"] = [proc.returncode for proc in procs]
    print(f"exit_codes: {figures['exit_codes']} (group order; the victim's is its restart's)")
    return figures


def summarise_failure(args: argparse.Namespace, rows: list[dict], fault_at: float | None,
                      restart_at: float | None) -> dict:
    """Print the per-step table and return the figures."""
    committed: dict[int, dict[int, dict]] = {}
    for row in rows:
        if row["committed"]:
            committed.setdefault(row["step"], {})[row["group"]] = row
    print(f"\nper step: groups that committed it (H: healed from a peer at that step); digest: "
          f"weights + AdamW state after the step\n{'step':>4}  " + "  ".join(f"g{g}" for g in range(args.groups))
          + "  participants  states equal")
    unequal = []
    for step in sorted(committed):
        by_group = committed[step]
        marks = "  ".join((" H" if by_group[g]["healed"] else " x") if g in by_group else " ."
                          for g in range(args.groups))
        same = len({r["digest"] for r in by_group.values()}) == 1
        if not same:
            unequal.append(step)
        counts = sorted({r["participants"] for r in by_group.values()})
        print(f"{step:>4}  {marks}  {','.join(map(str, counts)):>12}  {'yes' if same else 'NO'}")
    victim_rows = [r for r in rows if r["group"] == args.victim and r["attempt"] == 1]
    survivors = [r for r in rows if r["group"] != args.victim]
    rejoin = next((r for r in victim_rows if r["committed"]), None)
    healed_step = next((r["step"] for r in victim_rows if r["healed"]), None)
    after_fault = [r for r in survivors if fault_at is not None and r["wall"] >= fault_at]
    lost = [r for r in after_fault if not r["committed"]]
    stall = max((r["step_s"] for r in after_fault), default=0.0)
    degraded = [s for s in committed if len(committed[s]) < args.groups
                and fault_at is not None and min(r["wall"] for r in committed[s].values()) >= fault_at]
    rejoined_equal = rejoin is not None and rejoin["step"] in committed and \
        len({r["digest"] for r in committed[rejoin["step"]].values()}) == 1
    figures = {
        "fault": args.fault, "kill_at": args.kill_at, "groups": args.groups,
        "heartbeat_timeout_ms": args.heartbeat_timeout_ms, "join_timeout_ms": args.join_timeout_ms,
        "pg_timeout_s": args.pg_timeout_s, "async_quorum": args.async_quorum, "allreduce": args.allreduce,
        "survivor_steps_not_committed": len(lost),
        "survivor_longest_step_after_fault_s": round(stall, 3),
        "steps_with_fewer_groups_after_fault": len(degraded),
        "samples_of_those_steps": sum(SAMPLES * len(committed[s]) for s in degraded),
        "samples_a_full_step_has": SAMPLES * args.groups,
        "restart_to_first_commit_s": round(rejoin["wall"] - restart_at, 3) if rejoin and restart_at else None,
        "fault_to_first_commit_s": round(rejoin["wall"] - fault_at, 3) if rejoin and fault_at else None,
        "rejoined_at_step": rejoin["step"] if rejoin else None, "healed_at_step": healed_step,
        "rejoined_state_equals_peers": rejoined_equal, "steps_with_unequal_states": unequal,
        "last_step_committed_by_all": max((s for s in committed if len(committed[s]) == args.groups), default=None),
    }
    print("\n" + "\n".join(f"{key}: {value}" for key, value in figures.items()))
    return figures


def overhead_phase(args: argparse.Namespace, folder: Path) -> dict:
    """Step times with nothing failing: torchft (synchronous and asynchronous quorum) vs plain DDP."""
    results: dict[str, dict] = {}
    for name, asynchronous in (("torchft_sync_quorum", False), ("torchft_async_quorum", True)):
        server = lighthouse(args)
        args.lighthouse = server.address()
        logs = [folder / f"{name}{g}.jsonl" for g in range(args.groups)]
        procs = [spawn(args, "replica", g, logs[g], steps=args.overhead_steps, step_sleep_s=0.0,
                       async_quorum=asynchronous) for g in range(args.groups)]
        wait_all(procs, args.limit_s)
        server.shutdown()
        rows = [r for log in logs for r in read_log(log) if r["step"] >= args.warmup]
        results[name] = {"median_step_ms": 1e3 * statistics.median(r["step_s"] for r in rows),
                         "median_start_quorum_ms": 1e3 * statistics.median(r["quorum_s"] for r in rows),
                         "median_should_commit_ms": 1e3 * statistics.median(r["commit_s"] for r in rows),
                         "uncommitted_steps": sum(not r["committed"] for r in rows), "steps": len(rows)}
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    logs = [folder / f"baseline{g}.jsonl" for g in range(args.groups)]
    wait_all([spawn(args, "baseline", g, logs[g], extra_env=env, steps=args.overhead_steps)
              for g in range(args.groups)], args.limit_s)
    rows = [r for log in logs for r in read_log(log) if r["step"] >= args.warmup]
    results["plain_ddp"] = {"median_step_ms": 1e3 * statistics.median(r["step_s"] for r in rows), "steps": len(rows)}
    base = results["plain_ddp"]["median_step_ms"]
    print(f"\nno failure, {args.groups} groups x 1 rank, MLP width {args.width}, {args.overhead_steps} steps "
          f"(first {args.warmup} dropped), medians over groups and steps:")
    for name, figures in results.items():
        figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
        results[name] = figures
        extra = f" (+{figures['median_step_ms'] - base:.2f} ms, {figures['median_step_ms'] / base:.2f}x)" \
            if name != "plain_ddp" else ""
        print(f"  {name}: {figures}{extra}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("job", "replica", "baseline"), default="job")
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--log", type=Path)
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--min-groups", type=int, default=2, help="lighthouse min_replicas and min_replica_size")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10, help="committed steps of the victim before the fault")
    parser.add_argument("--victim", type=int, default=1)
    parser.add_argument("--fault", choices=("kill", "stop", "none"), default="kill",
                        help="none: skip the failure phase")
    parser.add_argument("--stop-for-s", type=float, default=8.0, help="SIGSTOP held this long, then SIGKILL")
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--step-sleep-s", type=float, default=0.3, help="added to each step of the failure phase")
    parser.add_argument("--allreduce", choices=("manager", "ddp"), default="manager",
                        help="Manager.allreduce of the flattened gradients, or torchft.DistributedDataParallel")
    parser.add_argument("--async-quorum", action="store_true", help="failure phase with the asynchronous quorum")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="torchft's default: 5000")
    parser.add_argument("--join-timeout-ms", type=int, default=60000, help="torchft's default: 60000")
    parser.add_argument("--pg-timeout-s", type=float, default=10.0)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    parser.add_argument("--quorum-timeout-s", type=float, default=60.0)
    parser.add_argument("--overhead-steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--limit-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--keep", type=Path, help="keep the groups' logs in this folder")
    args = parser.parse_args()
    if args.role == "replica":
        replica(args)
        return
    if args.role == "baseline":
        baseline(args)
        return
    from importlib.metadata import version

    os.environ.setdefault("RUST_LOG", "error")  # the lighthouse in this process logs every quorum otherwise
    import torchft  # noqa: F401 - fail here, with its own message, where it is not installed

    print(f"torchft {version('torchft')}, torch {torch.__version__}, {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        figures = {"failure": failure_phase(args, folder)} if args.fault != "none" else {}
        if args.overhead_steps:
            figures["overhead"] = overhead_phase(args, folder)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

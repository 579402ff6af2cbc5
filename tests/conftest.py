"""Shared fixtures: compose configs exactly as ``train.py`` does, with a temporary run directory."""

from __future__ import annotations

import json
import math
import os
from collections import Counter

# The suite's tests are written for CPU ranks (gloo, several ranks on one machine, CPU numerics), and
# trainer.accelerator=auto would send them to a GPU wherever torch sees one: hiding GPUs at import, before anything
# initialises CUDA, hides them from this session and every process it starts (train.py subprocesses, ranks), so
# the suite behaves the same on any machine. DISTTRAIN_TEST_DEVICE=cuda keeps them, for the tests marked cuda.
if os.environ.get("DISTTRAIN_TEST_DEVICE") != "cuda":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
if "ATEN_CPU_CAPABILITY" in os.environ and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # inductor's cache does not key its CPU kernels by this variable: a kernel compiled for another instruction set
    # (the machine's default) is reused and computes garbage; a run under another capability compiles its own
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}")

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from disttrain.config import register

register()
ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"


def cuda_skip_reason() -> str | None:
    """Why tests marked ``cuda`` cannot run in this session, or None when they can (DISTTRAIN_TEST_DEVICE=cuda
    and torch sees a GPU)."""
    if os.environ.get("DISTTRAIN_TEST_DEVICE") != "cuda":
        return ("a GPU test: run it on a GPU machine with DISTTRAIN_TEST_DEVICE=cuda (the suite hides GPUs "
                "otherwise)")
    import torch

    if not torch.cuda.is_available():
        return "DISTTRAIN_TEST_DEVICE=cuda, but torch sees no GPU on this machine"
    return None


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
"""Each test file's measured seconds in the default suite (its tests' setup, call and teardown on one of two
workers), refreshed by ``make test PYTEST_ARGS=--file-seconds-out=tests/file_seconds.json``."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--file-seconds-out", default=None, metavar="PATH",
                     help="write each test file's seconds (setup, call and teardown of its tests) to PATH as JSON")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip, with the reason, where they cannot run (see ``cuda_skip_reason``); the files
    run longest first (``FILE_SECONDS``; a file not measured yet counts as longest)."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    reason = cuda_skip_reason() if marked else None
    for item in marked if reason else []:
        item.add_marker(pytest.mark.skip(reason=reason))
    # A worker is given a file at a time (--dist loadfile, in this order: --no-loadscope-reorder), so a long file
    # given out last keeps one worker busy after the other has finished; the sort is stable, a file's tests
    # keep their order.
    seconds = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], math.inf))


_file_seconds: Counter[str] = Counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _file_seconds[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = session.config.getoption("--file-seconds-out")
    if out and not hasattr(session.config, "workerinput"):  # the controller, which sees every worker's reports
        Path(out).write_text(json.dumps({name: round(value, 1) for name, value in sorted(_file_seconds.items())},
                                        indent=0) + "\n")


def train_cli(args: list[str], cwd: Path, timeout: int = 600, pythonpath: tuple[Path, ...] = ()):
    """``python train.py *args`` in ``cwd`` as a user runs it (one thread per rank; ``tests`` importable for
    test-only callbacks, and ``pythonpath`` for a user's modules); the completed process, whatever its exit
    status."""
    import os
    import subprocess
    import sys

    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []  # where Hydra may be installed
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(map(str, (ROOT, *pythonpath, *inherited)))}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def train_cli_in_process(args: list[str], cwd: Path, pythonpath: tuple[Path, ...] = (), timeout: int = 600):
    """``python train.py *args`` in ``cwd`` run in this process: ``train.py`` itself executed as ``__main__`` (its
    Hydra entry point, config search path and one-line errors, as the interpreter runs it), with the
    environment, import path and argv that :func:`train_cli` gives the subprocess. Ranks it starts are forked
    from this process's fork server, already warm (a new interpreter spends 7-9 s importing torch and Lightning
    before it reads its arguments). Returns ``returncode`` (0, or the ``SystemExit`` code), ``stdout`` and
    ``stderr`` as written at the file-descriptor level (the job prints rank 0's output as its own); everything
    the run changes in this process (cwd, argv, sys.path, environment, Hydra's global state, logging, signal
    handlers) is put back. Needs no fixture, so module-scoped fixtures can run commands too. A run past
    ``timeout`` seconds is interrupted (``TimeoutError``, status 1), as ``train_cli`` kills its subprocess."""
    import os
    import signal
    import sys

    def interrupt(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"train.py {' '.join(args)} ran past {timeout} s")

    saved = os.getcwd(), list(sys.argv), list(sys.path), dict(os.environ)
    with _captured_output() as output:
        try:
            os.chdir(cwd)
            sys.argv[:] = ["train.py", *args]
            sys.path[:0] = map(str, (ROOT, *pythonpath))
            os.environ["OMP_NUM_THREADS"] = "1"
            os.environ.pop("HYDRA_FULL_ERROR", None)
            previous = signal.signal(signal.SIGALRM, interrupt)
            signal.alarm(timeout)
            try:
                output.returncode = _run_train_py(pythonpath)
            finally:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, previous)
        finally:
            os.chdir(saved[0])
            sys.argv[:], sys.path[:] = saved[1], saved[2]
            os.environ.clear()
            os.environ.update(saved[3])
    return output


@contextmanager
def _captured_output() -> Iterator[SimpleNamespace]:
    """What this process writes to its standard output and error meanwhile, through Python or straight to file
    descriptors 1 and 2 (forked ranks write there): ``.stdout`` and ``.stderr`` once the block has ended."""
    import io
    import os
    import sys
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
    fds, streams = [os.dup(1), os.dup(2)], (sys.stdout, sys.stderr)
    output = SimpleNamespace(returncode=None, stdout="", stderr="")
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    sys.stdout, sys.stderr = (io.TextIOWrapper(os.fdopen(os.dup(fd), "wb"), encoding="utf-8", write_through=True)
                              for fd in (1, 2))
    try:
        yield output
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.close()
        sys.stdout, sys.stderr = streams
        for target, fd in zip((1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        for name, handle in zip(("stdout", "stderr"), files, strict=True):
            handle.seek(0)
            setattr(output, name, handle.read().decode("utf-8", errors="replace"))
            handle.close()


def _run_train_py(pythonpath: tuple[Path, ...]) -> int:
    """Execute ``train.py`` as ``__main__`` in the prepared directory and environment; its exit status. Puts back
    what the run changes beyond the directory, argv, path and environment (the caller restores those)."""
    import logging
    import runpy
    import signal
    import sys
    import traceback

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from disttrain.fault.config import PREEMPTION_SIGNALS

    modules = set(sys.modules)
    handlers = {sig: signal.getsignal(sig) for sig in (*PREEMPTION_SIGNALS, signal.SIGINT)}
    loggers = {name: (logger.level, logger.disabled, logger.propagate, list(logger.handlers))
               for name, logger in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]
               if isinstance(logger, logging.Logger)}
    hydra_config = HydraConfig.instance().cfg
    returncode = 0
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as stop:
        returncode = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    except Exception:  # as the interpreter ends on an uncaught error: its traceback and status 1
        traceback.print_exc()
        returncode = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = hydra_config
        for name, (level, disabled, propagate, kept) in loggers.items():
            logger = logging.getLogger(name or None)
            for handler in [h for h in logger.handlers if h not in kept]:  # Hydra's console and train.log
                logger.removeHandler(handler)
                handler.close()
            logger.setLevel(level)
            logger.disabled, logger.propagate, logger.handlers[:] = disabled, propagate, kept
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for name in set(sys.modules) - modules:  # a user's module from ``pythonpath``, imported by name
            module_file = getattr(sys.modules[name], "__file__", None) or ""
            if any(module_file.startswith(str(path)) for path in pythonpath):
                del sys.modules[name]
    return returncode


def attach(datamodule, num_replicas: int, rank: int):
    """Pretend a trainer with ``num_replicas`` data-parallel ranks is attached, as this ``rank``."""
    from types import SimpleNamespace

    datamodule.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank})
    return datamodule


NO_PLOTS = "plots=false"
"""Composed test runs draw no pictures unless their overrides say ``plots=true`` (the tests of pictures do):
drawing them took 0.4 s of a 0.9 s two-step run, in every one of the suite's hundreds of runs."""


def compose_config(overrides: list[str], run_dir: Path | str) -> DictConfig:
    """Compose ``conf/train.yaml`` with ``overrides`` and a fixed run directory (no plots unless asked)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[NO_PLOTS, *overrides, f"run_dir={run_dir}"])


@pytest.fixture
def make_config(tmp_path: Path):
    """Factory fixture: ``make_config(["model=gpt", ...])`` -> composed DictConfig with run_dir in tmp."""

    def make(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
        return compose_config(overrides, run_dir or tmp_path / "run")

    return make


def single_process_curve(tmp_path_factory: pytest.TempPathFactory, overrides: list[str]) -> list[float]:
    """Train ``overrides`` in one process and return its per-step loss curve (the parity reference)."""
    from disttrain.launch.job import train
    from tests.test_run import step_losses

    run_dir = tmp_path_factory.mktemp("single")
    train(compose_config(overrides, run_dir))
    return step_losses(run_dir)


def logged_metric(run_dir: Path, name: str) -> list[tuple[int, float]]:
    """``(csv step, value)`` of every row of ``csv/metrics.csv`` that logged ``name``."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as handle:
        return [(int(row["step"]), float(row[name])) for row in csv.DictReader(handle) if row.get(name)]


def exported_val_loss(run_dir: Path, checkpoint: Path, export_to: Path) -> float:
    """Export ``checkpoint`` as the run holds it (a LoRA run's adapters kept apart), load it into the bare model
    of the run's config in this process and return its validation loss on the samples the run validated on (all
    of them, or the first ``limit_val_batches`` global batches)."""
    from disttrain.checkpoint.export import export
    from disttrain.checkpoint.io import load_weights_file

    return val_loss_of_weights(run_dir, load_weights_file(export(checkpoint, export_to, merge_adapters=False)))


def val_loss_of_weights(run_dir: Path, weights: dict) -> float:
    """The validation loss of ``weights`` (a state dict of the run's model), loaded into the bare model in this
    process, on the samples the run validated on (all of them, or the first ``limit_val_batches`` global batches)."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from disttrain.config import validate
    from disttrain.data import build_datamodule
    from disttrain.models import build_model

    cfg = OmegaConf.load(run_dir / "config.yaml")
    run = validate(cfg, world_size=cfg.trainer.devices)
    datamodule = build_datamodule(run.data, run.batch.micro_size, run.train.seed)
    model = build_model(run.model, datamodule.spec)
    model.load_state_dict(weights, strict=True)
    model.eval()
    val = datamodule.datasets["val"]
    limit = run.train.trainer.limit_val_batches
    count = len(val) if limit is None else min(len(val), limit * run.batch.micro_size * run.dims.dp)
    total, targets_seen = 0.0, 0
    with torch.no_grad():
        for start in range(0, count, 64):
            samples = [val[i] for i in range(start, min(count, start + 64))]
            inputs, targets = (torch.stack(part) for part in zip(*samples, strict=True))
            logits = model(inputs)
            total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum").item()
            targets_seen += targets.numel()
    return total / targets_seen

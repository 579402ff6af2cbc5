"""An elastic world size with the same loss curve: a run that loses a rank restarts on fewer (``trainer.devices=
MIN:MAX``), a checkpoint resumes on more, and either way the global batch, the samples of the epoch (each exactly
once) and the loss curve are those of the uninterrupted run.

The runs: a 4-rank DDP run of 12 steps, one epoch of 96 windows at a global batch of 8 (micro-batch 2), save
points every 3 steps; the same with ``trainer.devices=2:4`` whose rank 3 is SIGKILLed after step 5, restarted from
step 3 on 2 ranks (accumulation 2: 3 old micro-batches are an odd count, so a restored counter left in them would
close the first window after one micro-batch); and the 2-rank checkpoint of step 9 resumed on 4 ranks. SGD with
momentum and clipping at a norm that some steps exceed and others do not: a gradient scaled wrongly or taken over
the wrong micro-batches, or a sample read twice, changes every later step.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from disttrain.checkpoint.elastic import rewrite_batch_progress
from disttrain.config.validation import validate
from disttrain.data.base import DataModule, InMemoryTensors
from disttrain.data.position import batches_done, epoch_position, samples_done, skip_per_rank
from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.launch.restart_all import RestartAll
from disttrain.launch.supervisor import Failure, RanksStopped
from disttrain.parallel.process_group import free_port
from disttrain.rank.elastic import changed_layout
from tests.conftest import ROOT, attach, compose_config, train_cli_in_process
from tests.fault_runs import signal_at
from tests.sample_log import samples_by_step
from tests.test_run import step_losses

STEPS, EVERY, KILL_AT, EPOCH = 12, 3, 5, 96
RUN = ["model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=32", f"data.samples_per_epoch={EPOCH}",
       "batch.global_size=8", "batch.micro_size=2", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1",
       "trainer.limit_val_batches=1", "trainer.run_test=false", f"trainer.val_check_interval={STEPS}",
       "trainer.check_val_every_n_epoch=null", "logger=csv", "callbacks=none", "optim=sgd",
       "trainer.gradient_clip_val=1.2", f"checkpoint.every_n_train_steps={EVERY}", "checkpoint.keep_last=3",
       "parallel=ddp", "+callbacks.samples._target_=tests.sample_log.RecordSamples"]
# measured (fp32, gloo): the changed runs' steps within 1.2e-7 relative of the uninterrupted run's
LOSS_RTOL = 1e-6


def run(args: list[str], run_dir: Path):
    """``train.py`` with ``RUN`` and ``args`` into ``run_dir``, in this process (ranks are forked); its exit status
    and output."""
    return train_cli_in_process([*RUN, *args, f"hydra.run.dir={run_dir}"], ROOT)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted 4-rank run."""
    run_dir = tmp_path_factory.mktemp("straight")
    done = run(["trainer.devices=4"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    """``trainer.devices=2:4``: rank 3 SIGKILLed after step 5; the restart runs on 2 ranks from step 3."""
    run_dir = tmp_path_factory.mktemp("shrunk")
    done = run(["trainer.devices=2:4", "fault_tolerance.max_restarts=1", *signal_at(KILL_AT, 3, signal.SIGKILL)],
               run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done


def assert_same_curve_and_samples(straight: Path, changed: list[Path]) -> None:
    """The changed run (its run directories in order) trained every step on the samples the uninterrupted run did,
    each sample of the epoch exactly once, and its loss curve is the uninterrupted one's within ``LOSS_RTOL``."""
    reference, ours = samples_by_step([straight]), samples_by_step(changed)
    everything = [i for ids in ours.values() for i in ids]
    curve, resumed = step_losses(straight), step_losses(changed[-1])
    deviation = max(abs(a - b) / abs(a) for a, b in zip(curve[-len(resumed):], resumed, strict=True))
    print(f"samples read over the change: {len(everything)}, distinct {len(set(everything))} of {EPOCH}; loss "
          f"curve: largest relative difference {deviation:.2e} over {len(resumed)} steps")
    assert sorted(ours) == list(range(1, STEPS + 1))
    assert sorted(everything) == list(range(EPOCH))  # the whole epoch, each window once
    assert ours == reference  # and in the same global batches
    assert len(curve) == STEPS and len(resumed) >= STEPS - 9  # from step 9 at the latest
    assert deviation <= LOSS_RTOL, (deviation, curve, resumed)


def test_a_lost_rank_restarts_the_run_on_the_ranks_left(straight, shrunk):
    run_dir, done = shrunk
    assert "rank 3 was killed by SIGKILL" in done.stderr
    assert "restarting on 2 ranks instead of 4 (rank 3's device presumed lost) (1 of 1)" in done.stderr
    assert "resumed on 2 data-parallel ranks instead of 4: accumulation 1 -> 2, global batch 8 kept" in done.stdout
    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 2
    assert results["batch"] == {"global": 8, "micro": 2, "accumulation": 2}
    assert results["fault_tolerance"]["world_size_changes"] == [
        {"from_ranks": 4, "to_ranks": 2, "from_dp": 4, "to_dp": 2, "at_step": EVERY}]
    assert "resumed at step 3 on 2 ranks instead of 4 (data-parallel 4 -> 2)" in done.stdout
    assert_same_curve_and_samples(straight, [run_dir])


def test_a_checkpoint_of_2_ranks_resumes_on_4(straight, shrunk, tmp_path):
    saved = shrunk[0] / "checkpoints" / "last-step9.ckpt"
    assert saved.is_dir()
    done = run(["trainer.devices=4", f"resume={saved}"], tmp_path / "grown")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed on 4 data-parallel ranks instead of 2: accumulation 2 -> 1, global batch 8 kept" in done.stdout
    changes = json.loads((tmp_path / "grown" / "results.json").read_text())["fault_tolerance"]["world_size_changes"]
    assert changes[-1] == {"from_ranks": 2, "to_ranks": 4, "from_dp": 2, "to_dp": 4, "at_step": 9}
    assert len(changes) == 2  # the history travels with the checkpoint
    assert_same_curve_and_samples(straight, [shrunk[0], tmp_path / "grown"])


def wait_for_listener(port: int, seconds: float = 60.0) -> None:
    """Until something accepts connections on ``port`` of this machine."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.mark.slow
def test_torchrun_with_a_range_of_nodes_goes_on_without_a_lost_node(straight, tmp_path):
    """Two torchrun agents (``--nnodes=1:2``, c10d rendezvous), one rank each; the second node loses power after
    step 5 (its agent and rank SIGKILLed). The first agent restarts its rank on the one node left: it validates
    again on its own world, resumes from step 3 with accumulation 4 and trains the same curve on the same samples.
    About 45 s: two interpreters start, then the survivor's restart starts a third after the rendezvous, which
    waits ``last_call_timeout`` for more nodes (10 s: a second agent that joins later than that, as a loaded
    machine made one do, finds the first node's round closed, and torch's agents then time out in the round that
    admits it)."""
    port, run_dir = free_port(), tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def agent(node: int, extra: list[str]) -> subprocess.Popen:
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
                   "--rdzv-conf=last_call_timeout=10", "--max-restarts=1", "--monitor-interval=0.2",
                   str(ROOT / "train.py"), *RUN, "trainer.num_nodes=1:2", *extra, f"hydra.run.dir={run_dir}"]
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    first = agent(0, [])
    wait_for_listener(port)  # the first agent hosts the rendezvous store, which must outlive the lost node
    second = agent(1, ["+callbacks.lose._target_=tests.crash.LoseNodeAtStep", f"+callbacks.lose.step={KILL_AT}"])
    lost = second.communicate(timeout=300)[0]
    out = first.communicate(timeout=300)[0]
    assert (first.returncode, second.returncode) == (0, -signal.SIGKILL), out[-3000:] + lost[-2000:]
    assert "resumed on 1 data-parallel ranks instead of 2: accumulation 2 -> 4, global batch 8 kept" in out
    results = json.loads((run_dir / "results.json").read_text())
    assert results["world_size"] == 1 and results["fault_tolerance"]["world_size_changes"] == [
        {"from_ranks": 2, "to_ranks": 1, "from_dp": 2, "to_dp": 1, "at_step": EVERY}]
    assert_same_curve_and_samples(straight, [run_dir])


class Numbered(DataModule):
    """96 samples whose input is their index."""

    @property
    def spec(self) -> DataSpec:
        return DataSpec(kind="image", num_classes=2, in_channels=1, image_size=1)

    def _datasets(self) -> dict:
        ids = torch.arange(EPOCH)
        return {"train": InMemoryTensors(ids, ids), "val": InMemoryTensors(ids, ids)}


def read(ranks: int, micro: int, accumulation: int, state: dict | None = None) -> list[list[int]]:
    """Each rank's samples of epoch 0 under this layout, after resuming from ``state``."""
    out = []
    for rank in range(ranks):
        datamodule = attach(Numbered(micro, seed=0), ranks, rank)
        datamodule.accumulation = accumulation
        if state is not None:
            datamodule.load_state_dict(state)
        loader = datamodule.train_dataloader()
        loader.sampler.set_epoch(0)
        out.append([int(i) for batch in loader for i in batch[0]])
    return out


@pytest.mark.parametrize(("before", "after"), [((4, 2, 1), (2, 2, 2)), ((2, 2, 2), (4, 2, 1)),
                                               ((4, 2, 1), (2, 4, 1)), ((4, 1, 2), (8, 1, 1))])
def test_a_position_in_samples_continues_on_any_layout(before, after):
    """Global batch 8, 3 steps done, then the rest of the epoch on another layout: each sample exactly once."""
    ranks, micro, accumulation = before
    first = [seen[:3 * micro * accumulation] for seen in read(*before)]
    state = epoch_position(0, 3 * accumulation, micro, accumulation, ranks)
    assert samples_done(state) == 24
    rest = read(*after, state)
    everything = sorted(i for seen in [*first, *rest] for i in seen)
    assert everything == list(range(EPOCH)), (before, after)
    assert batches_done(state, after[1], after[0]) * after[1] * after[0] == 24


def test_old_positions_keep_their_meaning_and_convert_where_they_can():
    # a position in micro-batches only: this run's micro-batches on every rank, as before
    assert skip_per_rank({"epoch": 0, "batches": 3}, 2, 2) == 6
    assert samples_done({"epoch": 0, "batches": 3}) is None
    assert batches_done({"epoch": 0, "batches": 3}, 2, 2) is None
    # with the micro-batch and data-parallel size that read it: converted to samples
    legacy = {"epoch": 0, "batches": 3, "micro_size": 2, "dp": 4}
    assert samples_done(legacy) == 24 and skip_per_rank(legacy, 2, 2) == 12
    rest = read(2, 2, 2, legacy)
    assert sorted(i for seen in rest for i in seen) == sorted(set(range(EPOCH)) - {i for seen in
                                                                                   read(4, 2, 1) for i in seen[:6]})


def progress(current: int, total: int, behind: int) -> dict:
    """Lightning's batch progress saved at the end of a batch: ``completed`` ``behind`` the other stages."""
    return {"epoch_loop.batch_progress": {
        "current": {"ready": current, "started": current, "processed": current, "completed": current - behind},
        "total": {"ready": total, "started": total, "processed": total, "completed": total - behind},
        "is_last_batch": False}}


@pytest.mark.parametrize(("per_step_before", "per_step_now"), [(1, 2), (2, 1), (3, 3)])
def test_the_loop_counters_count_the_resuming_runs_micro_batches(per_step_before, per_step_now):
    # one finished epoch of 12 steps, 4 steps into the second; saved at the end of the 4th step's last batch
    fit = progress(4 * per_step_before, 16 * per_step_before, 1)
    assert rewrite_batch_progress(fit, 4 * per_step_now, per_step_before, per_step_now)
    assert fit == progress(4 * per_step_now, 16 * per_step_now, 1)
    # Lightning closes a window where the count is a multiple of the accumulation: after the rewrite, the next
    # batches close one exactly every per_step_now batches
    current = fit["epoch_loop.batch_progress"]["current"]["ready"]
    assert [(current + i) % per_step_now == 0 for i in range(1, per_step_now + 1)] == \
        [False] * (per_step_now - 1) + [True]
    assert not rewrite_batch_progress({}, 4, 1, 2)


def test_the_change_is_said_in_one_line():
    assert changed_layout(4, 2, 1, 2, 2, 2) == \
        "resumed on 2 data-parallel ranks instead of 4: accumulation 1 -> 2, global batch 8 kept"
    assert changed_layout(4, 2, 1, 2, 4, 1) == \
        "resumed on 2 data-parallel ranks instead of 4: micro-batch 2 -> 4, global batch 8 kept"
    assert changed_layout(2, 2, 1, 4, 2, 1) == "resumed on 4 data-parallel ranks instead of 2: global batch 4 -> 8"


def supervisor(tmp_path: Path, sizes: tuple[int, ...]) -> RestartAll:
    return RestartAll(sizes[0], tmp_path / "config.yaml", tmp_path / "logs", 3, False, sizes)


def test_each_failure_costs_a_device_and_the_run_goes_on_on_the_largest_world_left(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ranks = supervisor(tmp_path, (4, 2))
    ranks._lose_device(Failure(0, 1, -9))  # 3 devices left: 2 ranks (the global batch refuses 3)
    assert (ranks.world_size, ranks.devices) == (2, [0, 2, 3])
    assert ranks._visible_devices() == {"CUDA_VISIBLE_DEVICES": "0,2"}
    ranks._lose_device(Failure(1, 0, -9))
    assert (ranks.world_size, ranks._visible_devices()) == (2, {"CUDA_VISIBLE_DEVICES": "2,3"})
    with pytest.raises(RanksStopped) as stopped:
        ranks._lose_device(Failure(2, 1, -9))
    assert "the run stopped: 3 of 4 devices are presumed lost and the 1 left are fewer than the 2 ranks it needs " \
           "at least" in str(stopped.value)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    ranks = supervisor(tmp_path, (4, 3, 2))
    ranks._lose_device(Failure(0, 0, 1))
    assert ranks._visible_devices() == {"CUDA_VISIBLE_DEVICES": "5,6,7"}
    assert supervisor(tmp_path, (4,))._visible_devices() == {}  # nothing lost: the machine's own setting
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # GPUs hidden: CPU ranks, no GPU named to the restarted ones
    ranks = supervisor(tmp_path, (4, 3))
    ranks._lose_device(Failure(0, 0, 1))
    assert ranks._visible_devices() == {}


def elastic_config(tmp_path: Path, *overrides: str):
    return compose_config(["model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=32",
                           "batch.global_size=8", "batch.micro_size=2", "parallel=ddp", "logger=csv",
                           "callbacks=none", *overrides], tmp_path)


def test_a_range_starts_on_its_largest_world_and_keeps_the_global_batch(tmp_path):
    run = validate(elastic_config(tmp_path, "trainer.devices=2:4", "batch.accumulation=1",
                                  "fault_tolerance.max_restarts=1"))
    assert (run.dims.world_size, run.world_sizes) == (4, (4, 2))  # 3 ranks cannot share a global batch of 8
    assert (run.batch.global_size, run.batch.micro_size, run.batch.accumulation) == (8, 2, 1)
    # the workers read the range and the batch that holds on every world of it: accumulation follows
    assert "devices: '2:4'" in run.yaml and "accumulation: null" in run.yaml
    # without a micro-batch the user's accumulation (1) is kept and the micro-batch follows
    run = validate(elastic_config(tmp_path, "trainer.devices=1:2", "batch.micro_size=null"))
    assert run.world_sizes == (2, 1) and "global_size: 8" in run.yaml and "micro_size: null" in run.yaml
    assert any("max_restarts=0: no restart" in notice for notice in run.notices)


def test_under_a_launcher_each_rank_checks_its_world_and_degrees_follow_it(tmp_path, monkeypatch):
    """torchrun --nnodes=1:4 restarts every rank on the nodes left; each validates again, on its own world."""
    for world, dp in ((4, 4), (2, 2)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        run = validate(elastic_config(tmp_path, "parallel=zero3", "trainer.num_nodes=1:4"))
        assert (run.dims.dp_shard, run.batch.global_size, run.batch.accumulation) == (dp, 8, 4 // dp)
        assert run.world_sizes == ()  # the launcher decides
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"trainer.devices='3:4' is invalid: a range that holds the launcher's 2 "
                                          r"ranks per node \(LOCAL_WORLD_SIZE\)"):
        validate(elastic_config(tmp_path, "trainer.devices=3:4"))
    with pytest.raises(ConfigError, match=r"trainer.num_nodes='2:4' is invalid: a range that holds the launcher's 1 "
                                          r"nodes"):
        validate(elastic_config(tmp_path, "trainer.num_nodes=2:4"))


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.devices=4:2"], r"trainer.devices='4:2' is invalid: MIN:MAX ranks per node with 1 <= MIN <= MAX"),
    (["trainer.devices=two:4"], r"trainer.devices='two:4' is invalid: MIN:MAX ranks per node"),
    (["trainer.devices=0:4"], r"trainer.devices='0:4' is invalid: MIN:MAX ranks per node"),
    (["trainer.devices=3:4"], r"trainer.devices='3:4' is invalid: a range whose smallest count the layout and the "
                              r"global batch allow; 3 does not \(batch.global_size=8 is invalid: a multiple of "
                              r"data-parallel size x batch.micro_size = 3 x 2 = 6\); counts from 3 to 4 that do: 4"),
    (["trainer.devices=3:4", "parallel=hybrid", "batch.global_size=4"],
     r"trainer.devices='3:4' is invalid: .* 3 does not \(parallel.dp_shard=-1 is invalid: the other degrees multiply "
     r"to 2, which does not divide world size 3\); counts from 3 to 4 that do: 4"),
    (["trainer.devices=2:4", "trainer.num_nodes=1:2"], r"trainer.num_nodes='1:2' is invalid: one number under "
                                                       r"disttrain's own supervisor"),
    (["trainer.devices=2:4", "trainer.num_nodes=2"], r"trainer.num_nodes=2 is invalid: 1 with trainer.devices=2:4 "
                                                     r"under disttrain's own supervisor"),
    (["trainer.num_nodes=x"], r"trainer.num_nodes='x' is invalid: a positive number of nodes, or MIN:MAX"),
    (["trainer.devices=2:4", "parallel=localsgd"], r"trainer.devices='2:4' is invalid: one number for a local sgd "
                                                   r"run"),
])
def test_ranges_that_cannot_run_are_refused_before_ranks_start(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(elastic_config(tmp_path, *overrides))

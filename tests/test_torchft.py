"""fault_tolerance.engine=torchft: a killed or stopped replica group costs the others a pause, never the run; it
comes back with its peers' state, bitwise; and what the engine cannot run is refused before ranks start."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from disttrain.config import validate
from disttrain.errors import ConfigError
from tests.conftest import ROOT, train_cli_in_process
from tests.fault_runs import assert_no_orphans
from tests.replica_probe import DIGESTS

pytest.importorskip("torchft")

STEPS, EVERY, KILL_AT = 40, 10, 5
HEARTBEAT_S = 1
"""The lighthouse leaves a silent group out of the next quorum after this long."""
SURVIVOR_GAP_S = 6.0
"""Longest time a surviving group may go without committing a step after a kill: the heartbeat timeout (1 s) plus
a 0.2 s step, with room for a 2-core CI machine also starting the replacement interpreter."""
REJOIN_S = 10.0
"""From the kill to the restarted group's first committed step: a rank forked from the job's fork server building
the run (about 1 s measured on 2 shared cores; a new interpreter importing torch, Lightning and torchft takes 8 to
10 s), the quorum and the state copy (< 0.1 s)."""
GROUP0_GAP_S = 15.0
"""Longest pause the survivors may take when group 0 dies during a step: the heartbeat timeout, the step they could
not commit and the restarted group's state copy, with room for a loaded 2-core machine; far below the cross-group
timeout (10 s here, 60 s by default) that a wait for the dead group would cost on top."""
LOG_EVERY = 4
"""Logger rows every this many steps in the group 0 test: a row counted by batches instead of committed steps falls
between two of them."""
STOP_TIMEOUT_S = 2
"""fault_tolerance.timeout_s of the SIGSTOP test: survivors caught in a collective with the stopped group wait this
long; the job kills the stopped group after HANG_S."""
HANG_S = 3
RUN = ["model=gpt", "model.flavour=micro", "data=pydocs", "data.block_size=32", "batch.global_size=12",
       f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=4",
       "trainer.run_test=false", f"trainer.val_check_interval={EVERY}", "trainer.check_val_every_n_epoch=null",
       "logger=csv", "callbacks=none", "fault_tolerance.engine=torchft", "fault_tolerance.min_groups=2",
       f"fault_tolerance.heartbeat_timeout_s={HEARTBEAT_S}", "fault_tolerance.max_restarts=1",
       f"fault_tolerance.hang_timeout_s={HANG_S}", "parallel.timeout_s=20",
       "+callbacks.digests._target_=tests.replica_probe.StepDigests", "+callbacks.digests.sleep_s=0.2"]
DDP3 = ["parallel=ddp", "trainer.devices=3"]


def signal_group(group: int, signum: int, mid_step: bool = False) -> list[str]:
    """Group ``group`` sends itself ``signum`` after its ``KILL_AT``-th committed step, in its first start; with
    ``mid_step``, during the next step (before the groups' exchange, which then fails in every group)."""
    return [f"+callbacks.digests.group={group}", f"+callbacks.digests.step={KILL_AT}",
            f"+callbacks.digests.signum={int(signum)}", *(["+callbacks.digests.mid_step=true"] if mid_step else [])]


def run(args: list[str], run_dir: Path, timeout_s: float = 10):
    """``train.py`` with ``RUN``, ``args`` and the cross-group ``timeout_s`` into ``run_dir``, in this process: the
    groups' ranks fork from its warm fork server (a job of its own would first start a fork server, importing
    torch and Lightning: 9 s of CPU a run)."""
    return train_cli_in_process([*RUN, *args, f"fault_tolerance.timeout_s={timeout_s}", f"hydra.run.dir={run_dir}"],
                                ROOT)


def digests(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / DIGESTS).read_text().splitlines()]


def final_val_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "results.json").read_text())["metrics"]["val/loss"]


def val_losses(run_dir: Path) -> dict[int, float]:
    """Validation loss by step, as group 0 logged it."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("val/loss")]
    return {int(float(row["step"])): float(row["val/loss"]) for row in rows}


def train_loss_steps(run_dir: Path) -> list[int]:
    """The step of every ``train/loss`` row of ``csv/metrics.csv``, in the file's order."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as handle:
        return [int(float(row["step"])) for row in csv.DictReader(handle) if row.get("train/loss")]


def assert_epoch_loss_is_the_steps_mean(run_dir: Path) -> None:
    """``train/loss_epoch`` is the mean of the run's logged step losses (the groups' means): also where the group
    that writes the rows was restarted, and so counts steps it did not train itself."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as handle:
        rows = list(csv.DictReader(handle))
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    epoch = [float(row["train/loss_epoch"]) for row in rows if row.get("train/loss_epoch")]
    assert len(losses) == STEPS and len(epoch) == 1
    assert epoch[0] == pytest.approx(sum(losses) / STEPS, rel=1e-5)


def assert_survivors_never_stopped(rows: list[dict], survivors: tuple[int, ...]) -> float:
    """Every survivor committed steps 1..STEPS in order, in one process; returns its longest pause."""
    longest = 0.0
    for group in survivors:
        own = [row for row in rows if row["group"] == group and row["rank"] == 0]
        assert [row["step"] for row in own] == list(range(1, STEPS + 1)), group  # never back, never skipped
        assert len({row["pid"] for row in own}) == 1, group  # never restarted
        longest = max(longest, *(b["time"] - a["time"] for a, b in zip(own, own[1:], strict=False)))
    return longest


def assert_rejoined_bitwise(rows: list[dict], group: int) -> int:
    """The restarted ``group`` holds, at its first committed step and every later one, the weights and optimiser
    state of every other group at that step, bitwise (rank by rank); returns that first step."""
    back = [row for row in rows if row["group"] == group and row["attempt"] == 1]
    assert back, f"group {group} never committed a step after its restart"
    first = min(row["step"] for row in back)
    for row in back:
        peers = {other["digest"] for other in rows if other["step"] == row["step"] and other["rank"] == row["rank"]}
        assert peers == {row["digest"]}, (row["step"], peers)
    return first


def assert_final_loss_bounded(run_dir: Path, reference: Path, section: dict) -> None:
    """The final validation loss of a run that lost a group, against the uninterrupted run's.

    Where every step ran with all groups and was committed, the runs read the same samples and took the same
    updates: the loss is bitwise the same. Otherwise each step with 2 of 3 groups averaged 8 of its 12 samples
    (the mean gradient of fewer samples: unbiased, noisier) and each uncommitted step dropped a batch; together
    they missed fewer samples than the uninterrupted run trains on in one validation interval (``EVERY`` steps),
    so the run ends no further from the uninterrupted one than that run moved in its last interval.
    """
    ours, theirs = final_val_loss(run_dir), final_val_loss(reference)
    degraded, dropped = section["steps_with_fewer_groups"], section["steps_not_committed"]
    if degraded == dropped == 0:
        assert ours == theirs
        return
    lost = section["samples_full_steps_would_have"] - section["samples_in_those_steps"] + 12 * dropped
    assert section["samples_full_steps_would_have"] - section["samples_in_those_steps"] == degraded * 4
    assert lost <= 12 * EVERY, lost
    straight = val_losses(reference)
    bound = straight[STEPS - EVERY] - straight[STEPS]
    assert abs(ours - theirs) <= bound, (ours, theirs, bound)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run of 3 groups of one rank; unpaced (no group fails, and the pause changes no number)."""
    run_dir = tmp_path_factory.mktemp("torchft-straight")
    done = run([*DDP3, "callbacks.digests.sleep_s=0"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def run_killing_group(run_dir: Path, group: int, args: list[str], gap_s: float) -> tuple[Any, int]:
    """A run of three groups whose ``group`` is SIGKILLed (``args``: the signal's overrides and more): it finishes,
    says which group died and that it restarts, the others pause less than ``gap_s``, and the restarted group
    rejoins bitwise. Its output and the step the group rejoined at."""
    done = run([*DDP3, *args], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"replica group {group}: rank 0 was killed by SIGKILL" in done.stderr
    assert f"restarting group {group} (1 of 1)" in done.stderr
    rows = digests(run_dir)
    pause = assert_survivors_never_stopped(rows, tuple(g for g in range(3) if g != group))
    assert pause < gap_s, pause
    return done, assert_rejoined_bitwise(rows, group)


def test_a_killed_group_rejoins_with_its_peers_state_while_the_others_train_on(reference, tmp_path):
    run_dir = tmp_path / "killed"
    done, first = run_killing_group(run_dir, 1, signal_group(1, signal.SIGKILL), SURVIVOR_GAP_S)
    # the restored loop counts batches as its peers do: it validates at the same steps
    after_restart = (run_dir / "logs" / "group1" / "rank0.log").read_text().split("--- restart 1 ---")[-1]
    assert re.findall(r"validation at step (\d+)", after_restart) == [str(s) for s in range(EVERY, STEPS + 1, EVERY)]
    section = json.loads((run_dir / "results.json").read_text())["fault_tolerance"]
    restart = section["group_restarts"][0]
    assert section["restarts"] == 1 and (restart["group"], restart["rejoined_at_step"]) == (1, first)
    assert restart["rejoin_s"] is not None and restart["rejoin_s"] < REJOIN_S, restart
    assert "killed by SIGKILL" in restart["cause"]
    membership = [json.loads(line) for line in (run_dir / "logs" / "membership.jsonl").read_text().splitlines()]
    assert any(row.get("healed") and row["group"] == 1 for row in membership)
    failed = [row for row in membership if row["event"] == "group_failed"]
    assert [(row["group"], row["cause"]) for row in failed] == [(1, "rank 0 was killed by SIGKILL")]
    back = [row for row in membership if row["event"] == "first_commit" and row["group"] == 1 and row["attempt"] == 1]
    assert back[0]["step"] == first and 0 < back[0]["rejoin_s"] < REJOIN_S
    assert_final_loss_bounded(run_dir, reference, section)
    assert "torchft: 3 replica groups; 1 group restart(s) (group 1:" in done.stdout
    assert "40 steps on 3 rank(s)" in done.stdout
    assert_epoch_loss_is_the_steps_mean(run_dir)
    assert_no_orphans(run_dir)


def test_group_0_killed_during_a_step_costs_the_others_a_short_pause_and_every_row_is_kept(tmp_path):
    run_dir = tmp_path / "group0"
    done, first = run_killing_group(
        run_dir, 0, [*signal_group(0, signal.SIGKILL, mid_step=True), f"trainer.log_every_n_steps={LOG_EVERY}"],
        GROUP0_GAP_S)
    section = json.loads((run_dir / "results.json").read_text())["fault_tolerance"]
    restart = section["group_restarts"][0]
    assert section["restarts"] == 1 and "killed by SIGKILL" in restart["cause"]
    assert (restart["group"], restart["failed_after_step"], restart["rejoined_at_step"]) == (0, KILL_AT, first)
    # the step in flight when group 0 died was committed by no group; the survivors alone committed every step
    # from the next one until the restarted group's first
    assert (section["steps_not_committed"], section["group_steps_not_committed"]) == (1, 2)
    alone = first - (KILL_AT + 1)
    assert section["steps_with_fewer_groups"] == alone, (section, first)
    assert section["samples_in_those_steps"] == 8 * alone and section["samples_full_steps_would_have"] == 12 * alone
    membership = [json.loads(line) for line in (run_dir / "logs" / "membership.jsonl").read_text().splitlines()]
    failed = [(row["group"], row["step"]) for row in membership if row["event"] == "group_failed"]
    assert failed == [(0, KILL_AT)]
    assert (f"torchft: 3 replica groups; 1 group restart(s) (group 0: rank 0 was killed by SIGKILL after step "
            f"{KILL_AT}, back at step {first} after ") in done.stdout
    assert f"{section['steps_with_fewer_groups']} step(s) with fewer groups" in done.stdout
    assert "1 step(s) not committed" in done.stdout
    # one row per logged step, the last included: the restarted group 0 continues the file its first start wrote
    assert train_loss_steps(run_dir) == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert_no_orphans(run_dir)


def test_a_stopped_group_is_left_behind_then_replaced(reference, tmp_path):
    # group 0, the one that writes the loggers' rows: the steps the others trained without it keep theirs
    run_dir = tmp_path / "stopped"
    done = run([*DDP3, *signal_group(0, signal.SIGSTOP)], run_dir, timeout_s=STOP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hung: rank 0 of replica group 0 sent no heartbeat" in done.stderr
    rows = digests(run_dir)
    pause = assert_survivors_never_stopped(rows, (1, 2))
    # the survivors go on once the lighthouse drops the silent group (HEARTBEAT_S), or after STOP_TIMEOUT_S where it
    # stopped inside their all-reduce; they never wait for the job to notice the hang (HANG_S)
    assert pause < STOP_TIMEOUT_S + HEARTBEAT_S + 2, pause
    first = assert_rejoined_bitwise(rows, 0)
    section = json.loads((run_dir / "results.json").read_text())["fault_tolerance"]
    restart = section["group_restarts"][0]
    assert restart["group"] == 0 and restart["cause"].startswith("hung")
    assert (restart["failed_after_step"], restart["rejoined_at_step"]) == (KILL_AT, first)
    # the others trained on while the job waited HANG_S: every step from the stop to the rejoining
    assert section["steps_with_fewer_groups"] == first - (KILL_AT + 1) >= 1, section
    # group 0 wrote no row from the one of step KILL_AT (it stopped after committing the step, before Lightning
    # wrote the row) to its rejoining: a training row each, a validation row every EVERY steps, came from the others
    missed = range(KILL_AT, first)
    assert section["rows_from_other_groups"] == len(missed) + sum(step % EVERY == 0 for step in missed)
    assert train_loss_steps(run_dir) == list(range(1, STEPS + 1))
    assert sorted(val_losses(run_dir)) == list(range(EVERY, STEPS + 1, EVERY))
    assert_epoch_loss_is_the_steps_mean(run_dir)
    assert_final_loss_bounded(run_dir, reference, section)
    assert_no_orphans(run_dir)


def test_a_group_that_did_not_commit_a_step_heals_in_place(tmp_path):
    run_dir = tmp_path / "refused"
    done = run([*DDP3, "+callbacks.digests.group=1", f"+callbacks.digests.step={KILL_AT}",
                "+callbacks.digests.refuse=true"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = digests(run_dir)
    assert_survivors_never_stopped(rows, (0, 2))
    own = [row for row in rows if row["group"] == 1]
    assert len({row["pid"] for row in own}) == 1  # no restart: the running group took its peers' state
    # it did not commit step KILL_AT + 1 (no record of it), then trained every later step bitwise with the others
    assert [row["step"] for row in own] == [s for s in range(1, STEPS + 1) if s != KILL_AT + 1]
    for row in own:
        assert {other["digest"] for other in rows if other["step"] == row["step"]} == {row["digest"]}, row["step"]
    membership = [json.loads(line) for line in (run_dir / "logs" / "membership.jsonl").read_text().splitlines()]
    healed = [row for row in membership if row.get("healed")]
    assert [(row["group"], row["attempt"], row["step"]) for row in healed] == [(1, 0, KILL_AT + 1)]
    section = json.loads((run_dir / "results.json").read_text())["fault_tolerance"]
    assert (section["steps_not_committed"], section["group_steps_not_committed"]) == (1, 1)
    assert_no_orphans(run_dir)


@pytest.mark.slow
def test_hsdp_groups_of_two_ranks_survive_a_killed_group(tmp_path):
    run_dir = tmp_path / "hsdp"
    done = run(["parallel=hsdp", "parallel.dp_replicate=3", "trainer.devices=6", *signal_group(2, signal.SIGKILL)],
               run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = digests(run_dir)
    assert_survivors_never_stopped(rows, (0, 1))
    assert_rejoined_bitwise(rows, 2)  # each rank's shard equals the same rank's shard in the other groups
    assert_no_orphans(run_dir)


def test_rows_only_other_groups_logged_are_added_in_step_order(tmp_path):
    from disttrain.fault.replica_rows import fill_missing_rows

    main, shadow = tmp_path / "metrics.csv", tmp_path / "group1.csv"
    main.write_text("epoch,step,train/loss\n0,1,5.0\n0,4,4.0\n")
    # a step's row with other columns (throughput), rows group 0 missed (steps 2, 3 and a validation), a later one
    shadow.write_text("epoch,step,train/loss,train/samples_per_sec,val/loss\n0,1,5.0,9.0,\n0,2,4.7,9.0,\n"
                      "0,3,4.5,9.0,\n0,3,,,4.6\n0,4,4.0,9.0,\n0,5,3.9,9.0,\n")
    assert fill_missing_rows(main, [shadow, tmp_path / "group2.csv"]) == 4
    lines = main.read_text().splitlines()
    assert lines[0] == "epoch,step,train/loss,train/samples_per_sec,val/loss"
    assert lines[1:] == ["0,1,5.0,,", "0,2,4.7,9.0,", "0,3,4.5,9.0,", "0,3,,,4.6", "0,4,4.0,,", "0,5,3.9,9.0,"]
    assert fill_missing_rows(main, [shadow]) == 0


VALID = ["fault_tolerance.engine=torchft", "parallel=ddp", "trainer.devices=3", "batch.global_size=12"]
GPT = ["model=gpt", "model.flavour=micro", "data=pydocs"]


@pytest.mark.parametrize(("overrides", "key", "allowed"), [
    (["fault_tolerance.engine=elastic"], "fault_tolerance.engine", "one of restart, torchft"),
    (["parallel=zero3", "trainer.devices=2"], "fault_tolerance.engine", "parallel.dp_replicate=1"),
    (["parallel=param_server", "trainer.devices=3"], "fault_tolerance.engine", "parameter servers"),
    (["parallel=localsgd", "trainer.devices=3"], "fault_tolerance.engine", "Local SGD"),
    (["parallel=federated"], "fault_tolerance.engine", "federated"),
    (["comm=powersgd"], "fault_tolerance.engine", "comm=powersgd"),
    (["model=cnn", "data=digits"], "fault_tolerance.engine", "BatchNorm"),  # the default model has BatchNorm
    (["fault_tolerance.min_groups=4"], "fault_tolerance.min_groups", "1 to parallel.dp_replicate=3"),
    (["fault_tolerance.min_groups=0"], "fault_tolerance.min_groups", "1 or more"),
    (["fault_tolerance.timeout_s=1800"], "fault_tolerance.timeout_s", "below parallel.timeout_s=1800"),
    (["fault_tolerance.heartbeat_timeout_s=0"], "fault_tolerance.heartbeat_timeout_s", "positive"),
    (["fault_tolerance.lighthouse=host:29510"], "fault_tolerance.lighthouse", "http://host:port"),
])
def test_what_torchft_cannot_run_is_refused_by_name(make_config, overrides, key, allowed):
    with pytest.raises(ConfigError) as info:
        validate(make_config([*VALID, *(overrides if "model=cnn" in overrides else [*GPT, *overrides])]))
    assert info.value.key == key, str(info.value)
    assert allowed in str(info.value), str(info.value)


def test_without_the_package_the_message_names_the_extra(make_config, monkeypatch):
    monkeypatch.setattr("disttrain.config.torchft_checks.torchft_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"pip install 'disttrain\[torchft\]'"):
        validate(make_config([*VALID, *GPT]))


def test_a_valid_config_is_the_torchft_kind(make_config):
    run = validate(make_config([*VALID, *GPT]))
    assert run.plan.kind == "torchft" and run.plan.trainer_accumulation == 1  # the task steps by hand
    assert run.dims.dp_replicate == 3

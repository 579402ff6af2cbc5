"""The rendezvous stores and the torchft lighthouse that a run on one machine hosts listen on loopback only, not on
every interface (where anyone who reaches the port could read and write the run's keys). The job's own
supervisor's store is checked from inside a real two-rank run (``test_worker_start.py``)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")


def listening_addresses(port: int) -> set[str]:
    """The local addresses on which some socket of this machine listens on TCP ``port`` (``0.0.0.0`` or ``::``:
    every interface)."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] != "0A" or int(hex_port, 16) != port:  # 0A: listening
                continue
            raw = bytes.fromhex(address)  # 32-bit words in the machine's (little-endian) order
            found.add(socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))
    return found


def test_a_hosted_store_listens_on_the_address_it_is_given():
    from disttrain.parallel.store import LOOPBACK, hosted_store

    store = hosted_store(LOOPBACK, 0)
    socket.create_connection((LOOPBACK, store.port)).close()  # reachable there
    assert listening_addresses(store.port) == {LOOPBACK}
    port = store.port
    del store
    assert listening_addresses(port) == set()  # the store closed the socket it was handed


def test_a_loopback_name_of_a_run_across_machines_listens_everywhere():
    # a host name that this machine's hosts file maps to loopback: the other machines reach it by another address
    from disttrain.parallel.store import hosted_store

    store = hosted_store("localhost", 0, one_machine=False)
    assert listening_addresses(store.port) & {"0.0.0.0", "::"}


def test_a_one_rank_run_hosts_its_process_groups_store_on_loopback():
    from lightning.fabric.plugins.environments import LightningEnvironment

    from disttrain.launch.job import rank_environment, single_rank_environment
    from disttrain.parallel.process_group import init_process_group, shutdown_process_group

    env = single_rank_environment()
    with rank_environment(env):
        init_process_group(LightningEnvironment(), "gloo", 60)
        try:
            assert listening_addresses(int(env["MASTER_PORT"])) == {"127.0.0.1"}
        finally:
            shutdown_process_group()


class _Finished:
    """A rank that has already exited 0 (the part of a process the supervisors use)."""

    pid = None

    def poll(self) -> int:
        return 0

    def kill(self) -> None:
        pass

    def wait(self) -> int:
        return 0


def test_the_torchft_supervisors_lighthouse_and_stores_listen_on_loopback(tmp_path, monkeypatch):
    pytest.importorskip("torchft")
    from disttrain.fault.config import FaultToleranceConfig
    from disttrain.fault.replica_groups import JOB_STORE_VAR, LIGHTHOUSE_VAR
    from disttrain.launch.restart_group import RestartGroup

    monkeypatch.setenv("RUST_LOG", "error")
    seen = {}

    def launch(_group, _rank, env):  # what listens while the ranks would start
        for name, address in (("lighthouse", env[LIGHTHOUSE_VAR]), ("job store", env[JOB_STORE_VAR]),
                              ("group store", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")):
            seen[name] = (address, listening_addresses(int(address.rsplit(":", 1)[1])))
        return _Finished()

    supervisor = RestartGroup(1, 1, tmp_path / "config.yaml", tmp_path / "logs", FaultToleranceConfig(), False)
    monkeypatch.setattr(supervisor, "_launch", launch)
    assert supervisor.run() == 0
    assert {name: listening for name, (_, listening) in seen.items()} == {
        "lighthouse": {"127.0.0.1"}, "job store": {"127.0.0.1"}, "group store": {"127.0.0.1"}}
    assert all(address.rsplit(":", 1)[0] in ("http://127.0.0.1", "127.0.0.1") for address, _ in seen.values()), seen

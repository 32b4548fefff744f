"""A master SIGKILLed and restarted on the same port, with real clients that never restart:
with --state-dir every object on the surviving (remounted) segments is readable byte-exact;
without it, the clients re-register by themselves and new puts work. A partitioned master
(its later partitions on new free ports after the restart) is restarted the same way."""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire.status import KVPoolError, Status

NUM_OBJECTS = 200
SIZE_BYTES = 16 << 10


def _workers() -> Any:
    spec = importlib.util.spec_from_file_location("kvpool_fault_workers",
                                                  Path(__file__).with_name("_workers.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


workers = _workers()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def config(address: str, **changes: Any) -> ClientConfig:
    values: dict[str, Any] = {"master_server_address": address, "global_segment_size": "16mb",
                              "rpc_timeout_s": 2, "heartbeat_interval_s": 0.2}
    values.update(changes)
    return ClientConfig.from_dict(values)


def retry(call: Any, timeout_s: float,
          also: frozenset[Status] = frozenset()) -> tuple[Any, float]:
    """Call until it stops raising retryable errors (or errors in ``also``); (result, seconds
    it took)."""
    started = time.monotonic()
    while True:
        try:
            return call(), time.monotonic() - started
        except KVPoolError as exc:
            assert exc.retryable or exc.status in also, exc
            assert time.monotonic() - started < timeout_s, exc
            time.sleep(0.1)


@pytest.mark.parametrize("partitions", [1, 3])
def test_restart_with_state_dir_keeps_every_object_byte_exact(start_master: Any,
                                                              tmp_path: Path,
                                                              partitions: int) -> None:
    # The restored free space is held back for write_capability_ttl after the restart
    # (write capabilities of the killed master may still be in use): puts answer NO_SPACE
    # until then rather than evict restored objects.
    flags = {"host": "127.0.0.1", "port": free_port(), "fast_port": 0, "metrics_port": 0,
             "client_ttl": 2, "state_dir": str(tmp_path / "state"), "restore_grace": 10,
             "write_capability_ttl": 3, "partitions": partitions}
    master = start_master(default_ports=False, **flags)
    keys = [f"restart-{i}" for i in range(NUM_OBJECTS)]
    with KVPoolClient(config(master.address)) as owner:
        statuses = owner.put_batch(keys, [workers.payload(k, SIZE_BYTES) for k in keys])
        assert all(s == 0 for s in statuses)
        master.kill()
        restarted = start_master(default_ports=False, **flags)
        assert restarted.master_id == master.master_id
        # later partitions serve on new free ports: the client learns them when it registers
        assert len(restarted.partitions) == (partitions if partitions > 1 else 0)
        # The owner notices UNKNOWN_CLIENT, re-registers and remounts its segment by itself.
        _, took_s = retry(lambda: owner.put("after-restart", b"x" * 100), timeout_s=15,
                          also=frozenset({Status.NO_SPACE}))
        with KVPoolClient(config(restarted.address, global_segment_size=0)) as reader:
            values = reader.get_batch(keys)
        exact = sum(v == workers.payload(k, SIZE_BYTES) for k, v in zip(keys, values,
                                                                         strict=True))
        print(f"owner re-registered {took_s:.2f} s after restart "
              f"(reregistrations {owner.metrics.reregistrations})")
        print(f"objects readable after restart: {exact}/{NUM_OBJECTS} byte-exact")
        assert owner.metrics.reregistrations >= 1
        assert exact == NUM_OBJECTS


@pytest.mark.parametrize("partitions", [1, 3])
def test_restart_without_state_dir_clients_recover(start_master: Any, partitions: int) -> None:
    flags = {"host": "127.0.0.1", "port": free_port(), "fast_port": 0, "metrics_port": 0,
             "client_ttl": 2, "partitions": partitions}
    master = start_master(default_ports=False, **flags)
    with KVPoolClient(config(master.address)) as a, KVPoolClient(config(master.address)) as b:
        a.put("before", b"1" * 1000)
        master.kill()
        start_master(default_ports=False, **flags)
        _, took_s = retry(lambda: a.put("after-a", b"2" * 1000), timeout_s=15)
        retry(lambda: b.put("after-b", b"3" * 1000), timeout_s=15)
        readable = [b.get("after-a") == b"2" * 1000, a.get("after-b") == b"3" * 1000]
        print(f"without --state-dir: first put after restart in {took_s:.2f} s; new objects "
              f"readable across clients: {sum(readable)}/2; old object forgotten: "
              f"{a.get('before') is None}")
        assert all(readable)
        assert a.get("before") is None


def test_a_put_while_the_segments_are_mounted_again_waits_for_them(start_master: Any) -> None:
    # After a restart without --state-dir the master knows no segment until the clients
    # mount theirs again. The remount is slowed here (1 s between RegisterClient and the
    # MountSegment calls) so that puts land in that window for certain: they must wait for
    # the remount and get their space, not NO_SPACE.
    flags = {"host": "127.0.0.1", "port": free_port(), "fast_port": 0, "metrics_port": 0,
             "client_ttl": 2}
    master = start_master(default_ports=False, **flags)
    with KVPoolClient(config(master.address)) as client:
        liveness = client.async_client.member.liveness
        assert liveness is not None
        segments, registered = liveness._segments, threading.Event()

        def slow_segments() -> Any:
            registered.set()  # registered again; no segment mounted yet
            time.sleep(1.0)
            return segments()

        liveness._segments = slow_segments
        puts = {"blocking": lambda key, value: client.put(key, value),
                "async": lambda key, value: client._thread.run(
                    client.async_client.put(key, value))}
        for driver, put in puts.items():
            registered.clear()
            master.kill()
            master = start_master(default_ports=False, **flags)
            assert registered.wait(timeout=10)
            started = time.monotonic()
            put(f"during-remount-{driver}", driver.encode() * 1000)
            print(f"{driver} put in the remount window took {time.monotonic() - started:.2f} s")
            assert client.get(f"during-remount-{driver}") == driver.encode() * 1000

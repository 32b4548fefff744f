"""Two client processes on one master: process A writes, process B reads (and writes into A's
segment), over shared memory and over forced TCP, checked byte for byte."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from helpers import client_worker

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire.status import Status
from kvpool_wire.types import PutOptions

cw = client_worker()


@pytest.fixture
def writer(master: Any) -> Iterator[Any]:
    worker = cw.Worker({"master_server_address": master.address, "global_segment_size": "64mb"})
    try:
        yield worker
    finally:
        worker.stop()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_writes_b_reads(master: Any, writer: Any, transport: str) -> None:
    a_segment = writer.info["segment_ids"][0]
    size = 300_001  # odd size: no accidental alignment
    keys = [f"x-{transport}-{i}" for i in range(6)]
    for api, chunk in (("put", keys[:2]), ("put_batch", keys[2:4]),
                       ("batch_put_regions", keys[4:])):
        answer = writer.call("put", keys=chunk, size=size, segment=a_segment, api=api)
        assert answer["statuses"] == ["OK"] * len(chunk), answer
    config = ClientConfig.from_dict({"master_server_address": master.address,
                                     "global_segment_size": "16mb", "transport": transport})
    with KVPoolClient(config) as reader:
        expected = [cw.payload(k, size) for k in keys]
        assert reader.get_batch(keys) == expected
        assert reader.get(keys[0]) == expected[0]
        dst = np.zeros(len(keys) * size, dtype=np.uint8)
        reader.register_buffer(dst)
        assert reader.batch_get_into(keys, dst, [i * size for i in range(len(keys))],
                                     [size] * len(keys)) == [size] * len(keys)
        assert dst.tobytes() == b"".join(expected)
        halves = [np.zeros(size // 3, np.uint8), np.zeros(size - size // 3, np.uint8)]
        assert reader.batch_get_regions([keys[5]], [halves]) == [size]
        assert halves[0].tobytes() + halves[1].tobytes() == expected[5]
        # the bytes really crossed over the transport asked for
        used = {t for (t, op) in reader.metrics.transfer_bytes if op == "read"}
        assert used == ({"tcp"} if transport == "tcp" else {"shm"})
        objects_read = len(keys) + 1 + len(keys) + 1
        assert reader.metrics.transfer_bytes[("tcp" if transport == "tcp" else "shm",
                                              "read")] == objects_read * size


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_b_writes_into_a_segment(master: Any, writer: Any, transport: str) -> None:
    a_segment = writer.info["segment_ids"][0]
    size = 1 << 20
    keys = [f"into-a-{transport}-{i}" for i in range(5)]
    config = ClientConfig.from_dict({"master_server_address": master.address,
                                     "global_segment_size": 0, "transport": transport})
    with KVPoolClient(config) as b:
        statuses = b.put_batch(keys, [cw.payload(k, size) for k in keys],
                               options=PutOptions(preferred_segment=a_segment))
        assert statuses == [Status.OK] * len(keys)
        b.put(keys[0], b"ignored: the key exists")
        b.flush()  # commits pipelined by put are answered before A looks
        used = {t for (t, op) in b.metrics.transfer_bytes if op == "write"}
        assert used == ({"tcp"} if transport == "tcp" else {"shm"})
    assert writer.call("check", keys=keys, size=size)["results"] == ["ok"] * len(keys)


def test_forced_tcp_through_host_id(master: Any) -> None:
    """Processes that believe they are on different hosts use tcp without being told to."""
    worker = cw.Worker({"master_server_address": master.address, "global_segment_size": "16mb"},
                       env={"KVPOOL_HOST_ID": "another-host"})
    try:
        keys = ["host-0", "host-1"]
        assert worker.call("put", keys=keys, size=70_000,
                           segment=worker.info["segment_ids"][0])["statuses"] == ["OK", "OK"]
        config = ClientConfig.from_dict({"master_server_address": master.address})
        with KVPoolClient(config) as reader:
            assert reader.get_batch(keys) == [cw.payload(k, 70_000) for k in keys]
            assert {t for t, _ in reader.metrics.transfer_bytes} == {"tcp"}
    finally:
        worker.stop()


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_churn_through_another_process_segment_never_runs_out_of_space(
        start_master: Any, transport: str) -> None:
    """put -> get -> remove(force) in batches of 8 x 1 MiB, four times the size of the only
    segment (another process's), with 30 s leases: every batch fits, because each read gives
    its lease back (sent with the remove) and the forced remove frees the bytes at once."""
    master = start_master(default_kv_lease_ttl=30_000)
    owner = cw.Worker({"master_server_address": master.address, "global_segment_size": "64mb"})
    try:
        config = ClientConfig.from_dict({"master_server_address": master.address,
                                         "global_segment_size": 0, "transport": transport})
        with KVPoolClient(config) as c:
            values = [np.full(1 << 20, i, dtype=np.uint8) for i in range(8)]
            failures = []
            for round_ in range(32):                        # 256 MiB through 64 MiB
                keys = [f"churn-{round_}-{i}" for i in range(8)]
                statuses = c.put_batch(keys, values)
                failures += [s for s in statuses if s != Status.OK]
                got = c.get_batch(keys)
                assert all(g is not None and g[:1] == bytes([i]) for i, g in enumerate(got))
                assert c.batch_remove(keys, force=True) == [Status.OK] * 8
            assert failures == []
    finally:
        owner.stop()


def test_a_client_its_process_never_closed_leaves_the_pool_at_exit(start_master: Any) -> None:
    # The client TTL is long: only the exiting process itself can take its objects out now.
    master = start_master(client_ttl=300)
    script = (
        "import sys\n"
        "from kvpool_client import KVPoolClient\n"
        "from kvpool_client.config import ClientConfig\n"
        "c = KVPoolClient(ClientConfig.from_dict({'master_server_address': sys.argv[1],\n"
        "                                         'global_segment_size': '8mb'}))\n"
        "c.put('left-behind', b'x' * 1000)\n"
        "import os; print(os.getpid(), flush=True)\n"  # and exits without close()
    )
    done = subprocess.run([sys.executable, "-c", script, master.address], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "closing an unclosed kvpool client" not in done.stderr, done.stderr
    pid = done.stdout.strip()
    assert pid.isdigit()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("kvpool.")
                and n.split(".")[4:5] == [pid]]  # its segment's file is gone
    config = ClientConfig.from_dict({"master_server_address": master.address})
    with KVPoolClient(config) as reader:
        assert reader.exists("left-behind") is False


@pytest.mark.parametrize("commit_nowait", [False, True])  # the blocking and the asyncio driver
def test_replicas_say_where_objects_lie_and_read_nothing(master: Any, writer: Any,
                                                         commit_nowait: bool) -> None:
    a_segment = writer.info["segment_ids"][0]
    keys = [f"where-{commit_nowait}-{i}" for i in range(3)]
    answer = writer.call("put", keys=keys, size=5000, segment=a_segment, api="put_batch")
    assert answer["statuses"] == ["OK"] * 3, answer
    config = ClientConfig.from_dict({"master_server_address": master.address,
                                     "commit_nowait": commit_nowait})
    with KVPoolClient(config) as reader:
        found = reader.batch_replicas([*keys, "where-missing"])
        assert found[3] is None
        for where in found[:3]:
            assert where is not None
            size, replicas = where
            assert size == 5000 and len(replicas) == 1
            placement, segment = replicas[0]
            assert placement.segment_id == a_segment and placement.length == 5000
            assert segment is not None and segment.tcp_endpoint == writer.info["hostname"]
        offsets = sorted(w[1][0][0].offset for w in found[:3] if w is not None)
        assert len(set(offsets)) == 3  # three distinct extents
        assert not any(reader.metrics.transfer_bytes.values())  # no byte was read
        # the lookup took a read lease, as a read does (Mooncake's lookup too) ...
        assert reader.batch_remove(keys[:1]) == [Status.HAS_LEASE]
        # ... and gave its holds back with that very call
        with urllib.request.urlopen(master.metrics_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        ended = re.search(r"^kvpool_leases_ended_total (\S+)", text, re.M)
        assert ended is not None and float(ended.group(1)) >= 3

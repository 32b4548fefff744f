"""A partitioned master (``--partitions``), real processes on 127.0.0.1: clients in two
processes write and read each other's keys through every partition, each partition holding
its share of the keys and of each segment; a later partition registers nobody without
partition 0's ticket; the partitions stop together whichever of them goes; a partitioned
state directory restores under the same count and is refused under another; a client that
dies expires on every partition; a partition places no key of another (README, "Partitions")."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import launch_master, pid_alive, stop_pid
from helpers import client_worker, free_ports, wait_until

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.rpc import BlockingMasterRpc, MasterRpc
from kvpool_wire import calls
from kvpool_wire.partitions import partition_of, partitions_of
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo

cw = client_worker()
SIZE = 10_000


def status_of(partition: dict[str, Any]) -> dict[str, Any]:
    """One partition's /status document."""
    url = f"http://127.0.0.1:{partition['metrics_port']}/status"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return dict(json.loads(answer.read()))


def config(master: Any, **changes: Any) -> ClientConfig:
    return ClientConfig.from_dict({"master_server_address": master.address,
                                   "global_segment_size": "32mb", "rpc_timeout_s": 5, **changes})


def test_clients_of_a_partitioned_master_read_each_others_keys(start_master: Any) -> None:
    master = start_master("--partitions", "3")
    assert len(master.partitions) == 3 and master.partitions[0]["pid"] == master.pid
    assert len({p["grpc_port"] for p in master.partitions}) == 3
    keys = [f"part-{i}" for i in range(300)]
    worker = cw.Worker({"master_server_address": master.address, "global_segment_size": "32mb"})
    try:
        assert worker.call("put", keys=keys, size=SIZE)["statuses"] == ["OK"] * len(keys)
        for transport in ("auto", "tcp"):
            with KVPoolClient(config(master, transport=transport)) as reader:
                assert reader.get_batch(keys + ["absent"]) == \
                    [cw.payload(k, SIZE) for k in keys] + [None]
                assert reader.batch_exists(keys[:5] + ["absent"]) == [True] * 5 + [False]
                # a chain: the prefix ends at the first key some partition lacks
                assert reader.query_prefix(keys[:40] + ["absent"] + keys[40:50]) == 40
                reader.put(f"from-{transport}", cw.payload(f"from-{transport}", SIZE))
                assert worker.call("check", keys=[f"from-{transport}"], size=SIZE)["results"] \
                    == ["ok"]
        # each partition holds the keys of its share, on its share of every segment
        owners = [partition_of(k.encode(), 3) for k in keys]
        documents = [status_of(p) for p in master.partitions]
        # (the readers' keys went with their segments when they left)
        assert [d["objects"]["ready"] for d in documents] == [owners.count(p) for p in range(3)]
        assert all(d["clients"] == 1 for d in documents)
        capacities = [d["capacity_bytes"]["DRAM"] for d in documents]
        assert sum(capacities) == 32 << 20 and max(capacities) - min(capacities) < 1 << 20

        async def merged() -> dict[str, Any]:
            rpc = MasterRpc(master.address)
            try:
                await rpc.register_client("stats-reader", "h", "")
                document = await rpc.get_stats()
                removed = await rpc.remove_by_regex("stats-reader", "^part-1", force=True)
                await rpc.unregister_client("stats-reader")
                return {"document": document, "removed": removed}
            finally:
                await rpc.close()
        answer = asyncio.run(merged())
        assert answer["document"]["partitions"] == 3
        assert answer["document"]["objects"]["ready"] == len(keys)
        assert answer["document"]["capacity_bytes"]["DRAM"] == 32 << 20
        assert answer["removed"] == sum(k.startswith("part-1") for k in keys)
        results = worker.call("check", keys=keys, size=SIZE)["results"]
        assert results == ["missing" if k.startswith("part-1") else "ok" for k in keys]
    finally:
        worker.stop()


def test_a_later_partition_registers_nobody_without_partition_0s_ticket(
        start_master: Any) -> None:
    master = start_master("--partitions", "2")

    async def register(port: int, **joining: bytes) -> Any:
        rpc = MasterRpc(f"127.0.0.1:{port}", use_fast_path=False)
        try:
            call = calls.register_client("intruder", "h", "", b"", **joining)
            return await rpc._run(call)
        finally:
            await rpc.close()
    later = master.partitions[1]["grpc_port"]
    assert asyncio.run(register(later)).status == Status.PERMISSION_DENIED
    assert asyncio.run(register(later, capability_key=b"k" * 32,
                                partition_ticket=b"t" * 32)).status == Status.PERMISSION_DENIED
    assert status_of(master.partitions[1])["clients"] == 0
    first = asyncio.run(register(master.grpc_port))
    assert first.status == Status.OK and len(first.partitions) == 2
    joined = asyncio.run(register(later, capability_key=first.capability_key,
                                  partition_ticket=first.partition_ticket))
    assert joined.status == Status.OK and joined.client_token == first.client_token


def test_an_earlier_holder_of_an_id_cannot_push_the_later_one_out_with_its_old_ticket(
        start_master: Any) -> None:
    # X registers and keeps its key, token and ticket, then leaves; another process takes
    # the id X and puts objects on every partition; the earlier holder presents its old
    # ticket to partition 1: refused, and the later holder's objects there stay.
    master = start_master("--partitions", "2")
    earlier = BlockingMasterRpc(master.address, timeout_s=5)
    try:
        registration = earlier.register_client("X", "h", "h")
        key, token = registration.capability_key, earlier.session.token
        old_ticket = earlier.session.partition_ticket
        assert earlier.unregister_client("X") == Status.OK
        with KVPoolClient(config(master, client_id="X")) as later:
            keys = [f"held-{i}" for i in range(20)]
            assert later.put_batch(keys, [k.encode() * 100 for k in keys]) == [Status.OK] * 20
            mine = [k for k in keys if partition_of(k.encode(), 2) == 1]
            answer = earlier._run(calls.register_client("X", "h", "h", token, key, old_ticket),
                                  None, 1)
            kept = sum(later.batch_exists(mine))
            print(f"an earlier holder's old ticket at partition 1: {answer.status.name}; the "
                  f"later holder's objects there: {kept}/{len(mine)}")
            assert answer.status == Status.CLIENT_ALREADY_EXISTS and answer.capability_key == b""
            assert kept == len(mine)
            assert earlier._run(calls.heartbeat("X", token), None, 1)[0] == \
                Status.UNKNOWN_CLIENT
            assert later.get_batch(keys) == [k.encode() * 100 for k in keys]
    finally:
        earlier.close()


@pytest.mark.parametrize("killed", ["later", "first", "term"])
def test_the_partitions_stop_together(start_master: Any, killed: str) -> None:
    master = start_master("--partitions", "3")
    later = [int(p["pid"]) for p in master.partitions[1:]]
    assert all(pid_alive(pid) for pid in later)
    if killed == "later":   # one partition dies: the master stops, exit code 1
        os.kill(later[0], signal.SIGKILL)
        assert master.proc.wait(30) == 1
        assert "partition 1 exited" in master.log()
    elif killed == "first":  # partition 0 dies: the others see their stdin close
        os.kill(master.pid, signal.SIGKILL)
        master.proc.wait(10)
    else:
        assert master.stop(timeout_s=30) == 0
    assert all(stop_pid(pid, timeout_s=30) for pid in later)   # gone by themselves


def test_a_partitioned_state_directory_restores_under_its_count_only(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    workdir = tmp_path / "masters"
    keys = [f"kept-{i}" for i in range(60)]
    master = launch_master(workdir, "--partitions", "2", "--state-dir", str(state),
                           "--restore-grace", "30")
    worker = None
    try:
        worker = cw.Worker({"master_server_address": master.address,
                            "global_segment_size": "16mb", "rpc_timeout_s": 5})
        assert worker.call("put", keys=keys, size=SIZE)["statuses"] == ["OK"] * len(keys)
        assert master.stop(timeout_s=30) == 0
        assert sorted(os.listdir(state)) == ["partition-0", "partition-1", "partitions"]
        with pytest.raises(RuntimeError, match="--partitions 2"):
            launch_master(workdir, "--partitions", "3", "--state-dir", str(state),
                          "--port", "0")
        with pytest.raises(RuntimeError, match="--partitions 2"):
            launch_master(workdir, "--state-dir", str(state))
        # the same count: both partitions restore their share; the owner comes back to it
        master = launch_master(workdir, "--partitions", "2", "--state-dir", str(state),
                               "--restore-grace", "30", "--port", str(master.grpc_port))
        assert wait_until(lambda: worker.call("check", keys=keys[:1], size=SIZE)["results"]
                          == ["ok"], 30)
        assert worker.call("check", keys=keys, size=SIZE)["results"] == ["ok"] * len(keys)
        documents = [status_of(p) for p in master.partitions]
        assert sum(d["objects"]["ready"] for d in documents) == len(keys)
        assert all(d["objects"]["ready"] > 0 for d in documents)
    finally:
        if worker is not None:
            worker.stop()
        master.stop(timeout_s=30)
        for partition in master.partitions[1:]:
            stop_pid(int(partition["pid"]), timeout_s=15)


def test_a_client_that_dies_expires_on_every_partition(start_master: Any) -> None:
    master = start_master("--partitions", "2", "--client-ttl", "1")
    worker = cw.Worker({"master_server_address": master.address, "global_segment_size": "16mb",
                        "heartbeat_interval_s": 0.2})
    keys = [f"gone-{i}" for i in range(40)]
    try:
        assert worker.call("put", keys=keys, size=SIZE)["statuses"] == ["OK"] * len(keys)
        assert all(status_of(p)["clients"] == 1 for p in master.partitions)
        assert all(status_of(p)["objects"]["ready"] > 0 for p in master.partitions)
        os.kill(worker.pid, signal.SIGKILL)
        worker.proc.wait(10)
    finally:
        worker.stop()
    assert wait_until(lambda: all(status_of(p)["clients"] == 0 and
                                  status_of(p)["objects"]["ready"] == 0
                                  for p in master.partitions), 20)


def test_partitions_serve_on_fixed_ports_when_given(start_master: Any) -> None:
    base = free_ports(4)
    master = start_master("--partitions", "3", "--partition-ports", str(base))
    assert [(p["grpc_port"], p["fast_port"]) for p in master.partitions[1:]] == \
        [(base, base + 1), (base + 2, base + 3)]
    with KVPoolClient(config(master)) as client:
        client.put_batch([f"fixed-{i}" for i in range(30)], [b"v"] * 30)
        assert client.get_batch([f"fixed-{i}" for i in range(30)]) == [b"v"] * 30


@pytest.mark.parametrize("flags", [["--partitions", "0"], ["--partitions", "65"],
                                   ["--partitions", "two"],
                                   ["--partitions", "2", "--partition-ports", "50051"]])
def test_bad_partition_settings_are_refused(flags: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "kvpool_master.cli", *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "partition" in done.stderr


def test_each_partition_moves_its_objects_to_the_ssd_tier_and_back(start_master: Any,
                                                                     tmp_path: Path) -> None:
    master = start_master("--partitions", "2", eviction_high_watermark_ratio=0.8,
                          eviction_ratio=0.2)
    size = 256 << 10
    owner = cw.Worker({"master_server_address": master.address, "global_segment_size": 4 << 20,
                       "checksum": True, "ssd_path": str(tmp_path / "ssd"),
                       "ssd_segment_size": 64 << 20})
    reader = cw.Worker({"master_server_address": master.address, "global_segment_size": 0})
    try:
        keys = [f"tiered-{i}" for i in range(48)]   # three times DRAM
        for key in keys:
            assert owner.call("put", keys=[key], size=size)["statuses"] == ["OK"]
            time.sleep(0.02)
        assert wait_until(lambda: all(status_of(p)["used_bytes"]["SSD"] >= 8 * size
                                      for p in master.partitions), 20)
        tiers = owner.call("tiers", keys=keys)["tiers"]
        kept = [k for k, t in zip(keys, tiers, strict=True) if t is not None]
        assert len(kept) >= 40 and "SSD" in tiers
        assert set(reader.call("check", keys=kept, size=size)["results"]) == {"ok"}
        assert owner.call("ssd")["failed"] == 0 and owner.call("ssd")["done"] > 0
    finally:
        owner.stop()
        reader.stop()


def test_kvpool_status_of_a_partitioned_master_merges_every_partition(
        start_master: Any) -> None:
    master = start_master("--partitions", "2")
    assert status_of(master.partitions[0])["partition"]["count"] == 2
    assert len(status_of(master.partitions[0])["partition"]["endpoints"]) == 2
    with KVPoolClient(config(master, global_segment_size="8mb")) as client:
        keys = [f"status-{i}" for i in range(20)]
        client.put_batch(keys, [b"v" * 100_000] * 20)
        done = subprocess.run([sys.executable, "-m", "kvpool_client.cli", "status", "--master",
                               master.address, "--json"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        document = json.loads(done.stdout)
        assert document["partitions"] == 2 and "partition" not in document
        assert document["objects"]["ready"] == 20 and document["clients"] == 1
        assert document["capacity_bytes"]["DRAM"] == 8 << 20
        assert document["segments"]["list"][0]["capacity_bytes"] == 8 << 20
        text = subprocess.run([sys.executable, "-m", "kvpool_client.cli", "status", "--master",
                               master.address], capture_output=True, text=True, timeout=120)
        assert "(2 partitions, summed)" in text.stdout and "objects: 20 ready" in text.stdout
        rows = document["partition_list"]
        assert [row["index"] for row in rows] == [0, 1]
        assert [row["ready"] for row in rows] == \
            [sum(partition_of(k.encode(), 2) == p for k in keys) for p in (0, 1)]
        assert "PARTITION" in text.stdout and "SWEEP BACKLOG" in text.stdout


def test_a_partition_places_no_key_of_another_partition(start_master: Any) -> None:
    """A PutStart that carries a key of another partition is refused whole (no reader would
    look for the object there), and nothing is placed; its own keys alone are placed."""
    master = start_master("--partitions", "2")
    names = [f"own-{i}".encode() for i in range(40)]
    own = [k for k in names if partition_of(k, 2) == 1][:3]
    stray = next(k for k in names if partition_of(k, 2) == 0)
    with KVPoolClient(config(master)) as client:
        rpc = client._path.rpc   # the client's own stub, to send a call a router never would
        mixed = calls.put_start(client.client_id, rpc.session.token, [*own, stray],
                                [SIZE] * 4, PutOptions())
        with pytest.raises(KVPoolError) as refused:
            rpc._run(mixed, None, 1)
        assert refused.value.status == Status.INVALID_ARGUMENT
        assert "partition 0 of 2" in str(refused.value)
        objects = status_of(master.partitions[1])["objects"]
        assert objects["pending"] == objects["ready"] == 0
        answer = rpc._run(calls.put_start(client.client_id, rpc.session.token, own,
                                          [SIZE] * 3, PutOptions()), None, 1)
        assert [status for status, _ in answer] == [Status.OK] * 3
        assert status_of(master.partitions[1])["objects"]["pending"] == 3


def test_the_blocking_stub_sends_a_batch_to_every_partition_together(start_master: Any) -> None:
    """Over the blocking stub, which sends a batch's calls to every partition before it takes
    their answers: a batch spread over three partitions and cut by a small max_batch_keys
    into rounds answers per key, in key order; a partition that stopped answering fails its
    own keys only."""
    master = start_master("--partitions", "3", "--max-batch-keys", "50")
    name = "blocking-parts"
    keys = [b"bp-%04d" % i for i in range(400)]    # about 133 a partition: three rounds
    sizes = [4096 + i for i in range(len(keys))]   # sizes tell the keys' answers apart
    ok = [Status.OK] * len(keys)
    rpc = BlockingMasterRpc(master.address, timeout_s=10.0)
    try:
        rpc.register_client(name, "h", "")
        segment = SegmentInfo(SegmentId(f"{name}/0"), ClientId(name), 64 << 20)
        assert rpc.mount_segment(name, segment) == Status.OK
        assert [status for status, _ in rpc.put_start(name, keys, sizes, PutOptions())] == ok
        assert rpc.put_end(name, keys) == ok
        assert rpc.exist(name, keys) == (ok, sizes)
        assert [r.size_bytes for r in rpc.get_replicas(name, keys).results] == sizes
        assert rpc.query_prefix(name, keys) == len(keys)
        hasty = BlockingMasterRpc(master.address, timeout_s=0.3, session=rpc.session)

        async def hasty_aio() -> Any:
            stub = MasterRpc(master.address, timeout_s=0.3, session=rpc.session)
            try:
                return await stub.exist(name, keys)
            finally:
                await stub.close()
        stopped = int(master.partitions[2]["pid"])
        os.kill(stopped, signal.SIGSTOP)
        try:
            statuses, _ = hasty.exist(name, keys)
            aio_statuses, _ = asyncio.run(hasty_aio())   # the asyncio stub alike
        finally:
            os.kill(stopped, signal.SIGCONT)
            hasty.close()
        assert statuses == aio_statuses == [Status.TIMEOUT if owner == 2 else Status.OK
                                            for owner in partitions_of(keys, 3)]
        assert rpc.exist(name, keys) == (ok, sizes)
    finally:
        rpc.close()


def test_more_partitions_than_cores_is_said_in_the_log(start_master: Any) -> None:
    if shutil.which("taskset") is None:
        pytest.skip("taskset (util-linux) is not installed")
    one_core = ["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-m",
                "kvpool_master.cli"]
    master = start_master("--partitions", "2", executable=one_core)
    assert wait_until(lambda: "2 partitions on 1 core(s)" in master.log(), 10), master.log()
    with KVPoolClient(config(master)) as client:   # and it serves all the same
        client.put_batch([f"crowded-{i}" for i in range(20)], [b"v"] * 20)
        assert client.get_batch([f"crowded-{i}" for i in range(20)]) == [b"v"] * 20

"""The engine transport with a real transfer engine: Mooncake's ``TransferEngine`` from the
``mooncake-transfer-engine-non-cuda`` wheel, over the engine's own ``tcp`` protocol, between
client processes that each believe they are on another host (``KVPOOL_HOST_ID``), so no byte
takes shared memory.

The wheel is installed into a directory the client processes put on their path. Skipped, with
the reason, only when PyPI is unreachable or the wheel's native libraries cannot load here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import client_worker, install_mooncake_beside_kvpool

pytestmark = pytest.mark.network  # the engine wheel comes from PyPI at test time

HERE = Path(__file__).parent


cw = client_worker()


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real engine wheel and kvpool's ``mooncake.store`` hook, in one site directory."""
    site = tmp_path_factory.mktemp("engine-site")
    install_mooncake_beside_kvpool(site)
    probe = subprocess.run(
        [sys.executable, "-c", "from kvpool_client.transfer.engine import open_engine; "
                               "open_engine('127.0.0.1', 'tcp')"],
        env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
        timeout=60, stdin=subprocess.DEVNULL)
    if probe.returncode != 0:
        pytest.skip(f"the engine does not start here: {probe.stderr.strip()[-300:]}")
    return site


class Pool:
    """Client processes on one master; each its own host id; stopped by pid at the end."""

    def __init__(self, site: Path, address: str) -> None:
        self.site = site
        self.address = address
        self.workers: list[Any] = []

    def worker(self, host: str, *, engine: bool = True, **config: Any) -> Any:
        values = {"master_server_address": self.address, "global_segment_size": "64mb",
                  "heartbeat_interval_s": 0.2, **config}
        if engine:
            values.update(transport="engine", protocol="tcp")
        worker = cw.Worker(values, env={"PYTHONPATH": str(self.site), "KVPOOL_HOST_ID": host,
                                        "GLOG_minloglevel": "2"})
        self.workers.append(worker)
        return worker

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()


def engine_status(master: Any) -> dict[str, Any]:
    with urllib.request.urlopen(master.metrics_url + "/status", timeout=5) as reply:
        status: dict[str, Any] = json.loads(reply.read())["engine"]
    return status


@pytest.fixture
def pool(site_dir: Path, master: Any) -> Iterator[Pool]:
    pool = Pool(site_dir, master.address)
    try:
        yield pool
    finally:
        pool.stop()


def test_three_processes_put_and_get_byte_exact_through_the_engine(pool: Pool,
                                                                   master: Any) -> None:
    owner = pool.worker("host-a")
    writer = pool.worker("host-b", global_segment_size="16mb", local_buffer_size="1mb")
    reader = pool.worker("host-c", global_segment_size=0)
    # the pool spans the two engines that contribute segments, against HCCL's 512 devices
    assert engine_status(master) == {"endpoints": 2, "hccl_device_limit": 512,
                                     "within_hccl_limit": True}
    segment = owner.info["segment_ids"][0]
    size = 3_000_001  # odd, and three times the writer's staging buffer
    keys = [f"engine-{i}" for i in range(6)]
    for api, chunk in (("put", keys[:2]), ("put_batch", keys[2:4]),
                       ("batch_put_regions", keys[4:])):
        answer = writer.call("put", keys=chunk, size=size, segment=segment, api=api)
        assert answer["statuses"] == ["OK"] * len(chunk), answer
    writer.call("flush")
    small = [f"engine-small-{i}" for i in range(32)]
    assert writer.call("put", keys=small, size=4093)["statuses"] == ["OK"] * 32
    writer.call("flush")
    for who in (owner, writer, reader):
        for api in ("get_batch", "batch_get_into"):
            assert who.call("check", keys=keys, size=size, api=api)["results"] == \
                ["ok"] * len(keys)
        assert who.call("check", keys=small, size=4093)["results"] == ["ok"] * 32
    # every byte between the three crossed the engine (none took kvpool's TCP)
    assert writer.call("transports")["used"] == ["engine:read", "engine:write"]
    assert reader.call("transports")["used"] == ["engine:read"]


def test_a_pool_mixing_engine_and_plain_clients_falls_back_to_tcp(pool: Pool) -> None:
    with_engine = pool.worker("host-a")
    plain = pool.worker("host-d", engine=False)
    size = 1 << 20
    into_engine = [f"mixed-a-{i}" for i in range(4)]
    into_plain = [f"mixed-d-{i}" for i in range(4)]
    assert plain.call("put", keys=into_engine, size=size,
                      segment=with_engine.info["segment_ids"][0])["statuses"] == ["OK"] * 4
    assert with_engine.call("put", keys=into_plain, size=size,
                            segment=plain.info["segment_ids"][0])["statuses"] == ["OK"] * 4
    for who in (with_engine, plain):
        who.call("flush")
    for who in (with_engine, plain):
        assert who.call("check", keys=into_engine + into_plain, size=size)["results"] == \
            ["ok"] * 8
    # the plain client has no engine: kvpool's TCP both ways (its own segment: shared memory)
    assert plain.call("transports")["used"] == ["shm:read", "tcp:read", "tcp:write"]
    # the engine client reaches the plain client's segment through its data server
    assert "tcp:write" in with_engine.call("transports")["used"]


def test_an_injected_transfer_error_never_commits_and_never_reads(pool: Pool) -> None:
    owner = pool.worker("host-a")
    writer = pool.worker("host-b", global_segment_size="16mb")
    segment = owner.info["segment_ids"][0]
    before = [f"inject-before-{i}" for i in range(4)]
    assert writer.call("put", keys=before, size=65536, segment=segment)["statuses"] == \
        ["OK"] * 4
    writer.call("flush")
    # The owner's engine stops reaching its segments: every transfer to them fails.
    assert owner.call("engine_drop_segments")["dropped"] == 1
    after = [f"inject-after-{i}" for i in range(4)]
    answer = writer.call("put", keys=after, size=65536, segment=segment)
    assert "OK" not in answer.get("statuses", []), answer
    writer.call("flush")
    # nothing half-written was committed, and what was there reads as an error, never bytes
    results = writer.call("check", keys=before + after, size=65536)["results"]
    assert "ok" not in results and "mismatch" not in results, results
    assert owner.call("check", keys=after, size=65536)["results"] == ["missing"] * 4
    assert owner.call("check", keys=before, size=65536)["results"] == ["ok"] * 4  # shm


def test_an_owner_killed_during_reads_gives_errors_never_wrong_bytes(pool: Pool) -> None:
    owner = pool.worker("host-a")
    reader = pool.worker("host-b", global_segment_size=0)
    keys = [f"killed-{i}" for i in range(16)]
    size = 256 << 10
    assert owner.call("put", keys=keys, size=size)["statuses"] == ["OK"] * 16
    owner.call("flush")
    reader.send("check_loop", keys=keys, size=size, seconds=4.0)
    assert reader.read()["looping"]
    time.sleep(1.0)
    owner.kill()
    counts = reader.read(timeout_s=60)["counts"]
    assert counts.get("ok", 0) >= 16, counts        # it read before the kill
    assert "mismatch" not in counts, counts
    assert set(counts) - {"ok"}, counts             # and failed after it


def test_the_master_refuses_or_requires_the_engine(site_dir: Path, start_master: Any) -> None:
    refusing = start_master(engine_transport="refuse")
    pool = Pool(site_dir, refusing.address)
    try:
        with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
            pool.worker("host-a")
        pool.worker("host-b", engine=False)
    finally:
        pool.stop()
    requiring = start_master(engine_transport="require")
    pool = Pool(site_dir, requiring.address)
    try:
        with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
            pool.worker("host-b", engine=False)
        owner = pool.worker("host-a")
        writer = pool.worker("host-c", global_segment_size="16mb")
        assert writer.call("put", keys=["required"], size=1000,
                           segment=owner.info["segment_ids"][0])["statuses"] == ["OK"]
        writer.call("flush")
        assert owner.call("check", keys=["required"], size=1000)["results"] == ["ok"]
    finally:
        pool.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_master_restart_keeps_the_engine_pool_working(site_dir: Path, start_master: Any,
                                                        tmp_path: Path) -> None:
    flags = {"host": "127.0.0.1", "port": _free_port(), "fast_port": 0, "metrics_port": 0,
             "client_ttl": 2, "state_dir": str(tmp_path / "state"), "restore_grace": 10,
             "write_capability_ttl": 1}
    first = start_master(default_ports=False, **flags)
    pool = Pool(site_dir, first.address)
    try:
        owner = pool.worker("host-a")
        writer = pool.worker("host-b", global_segment_size="16mb")
        segment = owner.info["segment_ids"][0]
        before = [f"restart-before-{i}" for i in range(8)]
        assert writer.call("put", keys=before, size=100_000, segment=segment)["statuses"] == \
            ["OK"] * 8
        writer.call("flush")
        first.kill()
        start_master(default_ports=False, **flags)
        after = [f"restart-after-{i}" for i in range(8)]
        deadline = time.monotonic() + 30
        while True:  # the clients re-register and remount by themselves
            answer = writer.call("put", keys=after, size=100_000, segment=segment)
            if answer.get("statuses") == ["OK"] * 8:
                break
            assert time.monotonic() < deadline, answer
            time.sleep(0.3)
        writer.call("flush")
        for who in (owner, writer):
            # the objects put before the restart are readable once their owner has remounted
            # its segment, at its own next heartbeat (the writer's put may land before it)
            while (results := who.call("check", keys=before + after, size=100_000)["results"]
                   ) != ["ok"] * 16:
                assert time.monotonic() < deadline, results
                time.sleep(0.3)
        assert "engine:write" in writer.call("transports")["used"]
    finally:
        pool.stop()


STORE_SCRIPT = """
import json, os, site, sys
site.addsitedir({site!r})
import numpy as np
from mooncake.store import MooncakeDistributedStore
import mooncake.engine
assert hasattr(mooncake.engine.TransferEngine, "batch_transfer_sync_write")  # the real engine

role, master = sys.argv[1], sys.argv[2]
blocks, block_bytes, layers = 8, 64 << 10, 2
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master)
assert rc == 0, rc
# MindIE: one K and one V tensor per layer, registered whole; each block a sub-range of each
caches = [np.zeros(blocks * block_bytes, np.uint8) for _ in range(2 * layers)]
for cache in caches:
    assert store.register_buffer(cache.ctypes.data, cache.nbytes) == 0
keys = [f"mindie-block-{{b}}" for b in range(blocks)]
ptrs = [[c.ctypes.data + b * block_bytes for c in caches] for b in range(blocks)]
sizes = [[block_bytes] * len(caches) for _ in range(blocks)]
def expected(b, i):
    return np.random.default_rng(b * 100 + i).integers(0, 256, block_bytes, np.uint8)
if role == "writer":
    for b in range(blocks):
        for i, c in enumerate(caches):
            c[b * block_bytes:(b + 1) * block_bytes] = expected(b, i)
    out = store.batch_put_from_multi_buffers(keys, ptrs, sizes)
    print(json.dumps({{"put": out, "segment": store.get_hostname()}}), flush=True)
    sys.stdin.readline()  # stay in the pool until the reader is done
else:
    got = store.batch_get_into_multi_buffers(keys, ptrs, sizes)
    exact = all(np.array_equal(c[b * block_bytes:(b + 1) * block_bytes], expected(b, i))
                for b in range(blocks) for i, c in enumerate(caches))
    used = sorted({{f"{{t}}:{{o}}" for (t, o) in store._client.metrics.transfer_bytes}})
    print(json.dumps({{"get": got, "exact": bool(exact), "used": used}}), flush=True)
store.close()
"""


def test_the_drop_in_beside_the_wheel_moves_mindie_blocks_through_the_engine(
        site_dir: Path, master: Any, tmp_path: Path) -> None:
    """kvpool's ``mooncake.store`` with the real ``mooncake.engine`` in one environment;
    MindIE-shaped calls (whole K/V caches registered, block sub-ranges put and got)."""
    script = tmp_path / "store_role.py"
    script.write_text(textwrap.dedent(STORE_SCRIPT.format(site=str(site_dir))))
    config = tmp_path / "kvpool.json"
    config.write_text(json.dumps({"transport": "engine"}))  # kvpool-only key beside setup's

    def env(host: str) -> dict[str, str]:
        return {**os.environ, "KVPOOL_CONFIG_PATH": str(config), "KVPOOL_HOST_ID": host,
                "GLOG_minloglevel": "2"}

    with subprocess.Popen([sys.executable, str(script), "writer", master.address],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                          env=env("host-w")) as writer:
        try:
            assert writer.stdout is not None and writer.stdin is not None
            put = json.loads(writer.stdout.readline())
            assert put["put"] == [0] * 8, put
            reader = subprocess.run([sys.executable, str(script), "reader", master.address],
                                    capture_output=True, text=True, timeout=120,
                                    env=env("host-r"), stdin=subprocess.DEVNULL)
            assert reader.returncode == 0, reader.stderr[-2000:]
            got = json.loads(reader.stdout.strip().splitlines()[-1])
            # the writer's own segment (another host id): every byte through the engine
            assert got == {"get": [4 * (64 << 10)] * 8, "exact": True,
                           "used": ["engine:read"]}, got
            writer.stdin.write("done\n")
            writer.stdin.flush()
            assert writer.wait(60) == 0
        finally:
            if writer.poll() is None:
                os.kill(writer.pid, signal.SIGKILL)
                writer.wait(10)


ADDRESS_SCRIPT = """
import json, os, sys
sys.path.insert(0, {site!r})
import numpy as np
from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.core.regions import AddressRange
from kvpool_wire.status import KVPoolError, Status

master, engine = sys.argv[1], sys.argv[2] == "engine"
extra = {{"transport": "engine", "protocol": "tcp"}} if engine else {{}}
client = KVPoolClient(ClientConfig.from_dict({{"master_server_address": master,
                                              "global_segment_size": 0, **extra}}))
size = 200_001  # checksummed (under 256 KiB): a read by address cannot check it, and passes
src = np.random.default_rng(7).integers(0, 256, 3 * size, np.uint8)
dst = np.zeros(3 * size, np.uint8)
out = {{}}
try:
    client.register_memory(src.ctypes.data, src.nbytes)
    client.register_memory(dst.ctypes.data, dst.nbytes)
except KVPoolError as exc:
    out["register"] = exc.status.name
keys = [f"addr-{{sys.argv[2]}}-{{i}}" for i in range(3)]
ranges = [[AddressRange(src.ctypes.data + i * size, size)] for i in range(3)]
out["put"] = [s.name for s in client.batch_put_regions(keys, ranges)]
client.flush()
into = [[AddressRange(dst.ctypes.data + i * size, size)] for i in range(3)]
out["get"] = client.batch_get_regions(keys, into)
out["exact"] = bool(np.array_equal(src, dst))
stray = np.zeros(size, np.uint8)  # never registered
out["stray"] = client.batch_get_regions(keys[:1], [[AddressRange(stray.ctypes.data, size)]])
out["stray_untouched"] = not stray.any()
print(json.dumps(out), flush=True)
client.close()
"""


def test_ranges_known_by_address_move_in_place_only_through_an_engine(
        site_dir: Path, pool: Pool, tmp_path: Path) -> None:
    """What a device tensor registered with ``register_memory`` takes (here host memory, which
    the engine's tcp protocol reaches the same way): in place, or a clear error."""
    pool.worker("host-a")  # the only segment: every byte crosses to it
    script = tmp_path / "addresses.py"
    script.write_text(textwrap.dedent(ADDRESS_SCRIPT.format(site=str(site_dir))))

    def run(mode: str, host: str) -> dict[str, Any]:
        done = subprocess.run([sys.executable, str(script), pool.address, mode],
                              capture_output=True, text=True, timeout=120,
                              env={**os.environ, "KVPOOL_HOST_ID": host,
                                   "GLOG_minloglevel": "2"}, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-2000:]
        answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return answer

    with_engine = run("engine", "host-b")
    assert with_engine == {"put": ["OK"] * 3, "get": [200_001] * 3, "exact": True,
                           "stray": [(-600)], "stray_untouched": True}, with_engine
    without = run("plain", "host-c")
    assert without["register"] == "INVALID_ARGUMENT"
    assert without["put"] == ["INVALID_ARGUMENT"] * 3 and not without["exact"], without


ASYNC_SCRIPT = """
import asyncio, json, sys
sys.path.insert(0, {site!r})
sys.path.insert(0, {tests!r})
from helpers import client_worker
from kvpool_client.client import AsyncKVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire.types import PutOptions

payload = client_worker().payload

async def main() -> None:
    master, segment = sys.argv[1], sys.argv[2]
    config = ClientConfig.from_dict({{"master_server_address": master, "global_segment_size": 0,
                                     "transport": "engine", "protocol": "tcp"}})
    async with AsyncKVPoolClient(config) as client:
        keys = [f"async-{{i}}" for i in range(40)]
        size = 300_001
        # a batch large enough to be cut into concurrent sub-batches, then async writes
        statuses = await client.put_batch(keys[:32], [payload(k, size) for k in keys[:32]],
                                          options=PutOptions(preferred_segment=segment))
        for key in keys[32:]:
            await client.put(key, payload(key, size),
                             options=PutOptions(preferred_segment=segment), async_write=True)
        await client.flush()
        values = await client.get_batch(keys)
        used = sorted({{f"{{t}}:{{o}}" for (t, o) in client.metrics.transfer_bytes}})
        print(json.dumps({{"put": [int(s) for s in statuses],
                           "exact": [v == payload(k, size) for k, v in zip(keys, values)],
                           "used": used}}), flush=True)

asyncio.run(main())
"""


def test_the_async_client_moves_bytes_through_the_engine(site_dir: Path, pool: Pool,
                                                         tmp_path: Path) -> None:
    """The asyncio driver (pipelined sub-batches, async writes) runs the engine's blocking
    calls on worker threads; the bytes land byte-exact in another process's segment."""
    owner = pool.worker("host-a")
    script = tmp_path / "async_engine.py"
    script.write_text(textwrap.dedent(ASYNC_SCRIPT.format(site=str(site_dir),
                                                          tests=str(HERE.parent))))
    done = subprocess.run([sys.executable, str(script), pool.address,
                           owner.info["segment_ids"][0]], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "KVPOOL_HOST_ID": "host-b", "GLOG_minloglevel": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer == {"put": [0] * 32, "exact": [True] * 40,
                      "used": ["engine:read", "engine:write"]}, answer
    keys = [f"async-{i}" for i in range(40)]
    assert owner.call("check", keys=keys, size=300_001)["results"] == ["ok"] * 40


def test_a_target_killed_during_puts_fails_them_and_commits_nothing_wrong(pool: Pool) -> None:
    """Batches of writes into a segment whose owner is SIGKILLed part way: the writes after
    the kill fail (TRANSFER_FAILED until the master expires the owner, then NO_SPACE), none
    hangs, and nothing written reads wrong afterwards."""
    owner = pool.worker("host-a")
    writer = pool.worker("host-b", global_segment_size=0)
    segment = owner.info["segment_ids"][0]
    writer.send("put_loop", size=256 << 10, batch=8, count=400, prefix="killed-put",
                segment=segment)
    first = writer.read()
    assert first["statuses"] == ["OK"] * 8, first
    owner.kill()
    seen_failure = False
    while True:
        answer = writer.read(timeout_s=120)
        if answer.get("done"):
            break
        if answer["statuses"] != ["OK"] * 8:
            seen_failure = True
    assert seen_failure  # puts into the dead owner's segment failed, never hung
    reader = pool.worker("host-c", global_segment_size=0)
    results = reader.call("check", keys=[f"killed-put-0-{i}" for i in range(8)],
                          size=256 << 10)["results"]
    assert "mismatch" not in results and "ok" not in results, results  # gone with its owner

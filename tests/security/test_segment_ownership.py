"""Segments are proved, not described: a real master and real clients on 127.0.0.1.

- A segment an attacker mounts with a victim's shared-memory name and host id is never
  written through by an honest writer on that host (the ownership proof does not match).
- Sizes that the extent packing cannot describe, or no host has, are refused and change
  nothing; a client mounts a bounded number of segments.
- Start-up cleanup never removes a live segment of a process in another pid namespace
  (containers sharing /dev/shm), and still removes a dead one's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.rpc import MasterRpc
from kvpool_client.segments import SHM_DIR, cleanup_stale_segments
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, PutOptions, SegmentId, SegmentInfo


def config(address: str, **changes: Any) -> ClientConfig:
    values: dict[str, Any] = {"master_server_address": address, "global_segment_size": "4mb",
                              "rpc_timeout_s": 2, "heartbeat_interval_s": 0.2}
    values.update(changes)
    return ClientConfig.from_dict(values)


def test_a_fake_segment_naming_a_victims_memory_is_never_written_through(master: Any) -> None:
    values = {f"victim-{i}": os.urandom(64 << 10) for i in range(8)}
    with KVPoolClient(config(master.address)) as victim, \
            KVPoolClient(config(master.address, global_segment_size=0)) as writer:
        victim.put_batch(list(values), list(values.values()))

        async def mount_fake() -> list[Status]:
            rpc = MasterRpc(master.address, timeout_s=5.0)
            try:
                (real,) = await rpc.get_segments(victim.segment_ids[:1])
                assert real is not None
                await rpc.register_client("attacker", real.host_id, "")
                fake = SegmentInfo(SegmentId("attacker-seg0"), ClientId("attacker"),
                                   real.size_bytes, host_id=real.host_id,
                                   shm_name=real.shm_name)
                huge = [SegmentInfo(SegmentId(f"attacker-huge{i}"), ClientId("attacker"), size,
                                    host_id=real.host_id) for i, size in
                        enumerate((1 << 48, (1 << 46) + 1))]
                return [await rpc.mount_segment("attacker", s) for s in (fake, *huge)]
            finally:
                await rpc.close()

        mounted, *oversized = asyncio.run(mount_fake())
        assert mounted == Status.OK
        assert oversized == [Status.INVALID_ARGUMENT, Status.INVALID_ARGUMENT]
        refused = 0
        for i in range(8):   # first-fit puts on the fake segment land at the victim's offsets
            try:
                writer.put(f"honest-{i}", b"\xee" * (64 << 10),
                           options=PutOptions(preferred_segment="attacker-seg0"))
            except KVPoolError as exc:
                refused += exc.status == Status.PERMISSION_DENIED
        intact = sum(v == values[k] for k, v in zip(values, writer.get_batch(list(values)),
                                                    strict=True))
        print(f"puts aimed at a fake segment naming the victim's memory refused: {refused}/8; "
              f"victim's objects intact: {intact}/8")
        assert intact == len(values)
        assert refused == 8


def test_segments_per_client_are_bounded(start_master: Any) -> None:
    master = start_master(max_segments_per_client=2)

    async def mount_three() -> list[Status]:
        rpc = MasterRpc(master.address, timeout_s=5.0)
        try:
            await rpc.register_client("many", "h", "")
            return [await rpc.mount_segment("many", SegmentInfo(
                SegmentId(f"many-{i}"), ClientId("many"), 1 << 20, host_id="h"))
                for i in range(3)]
        finally:
            await rpc.close()

    assert asyncio.run(mount_three()) == [Status.OK, Status.OK, Status.RESOURCE_EXHAUSTED]


OWNER = textwrap.dedent("""
    import sys, time
    from kvpool_client.segments import LocalSegment
    segment = LocalSegment.create(sys.argv[1], "owner", 0, 1 << 20)
    print(segment.shm_name, flush=True)
    time.sleep(120)
""")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs unshare(1) and root to start a process in a new pid namespace")
def test_cleanup_keeps_a_live_segment_of_another_pid_namespace() -> None:
    cluster = f"ns-{uuid.uuid4().hex[:10]}"
    # The owner runs as pid 1 of its own pid namespace: the pid in its segment's name means
    # nothing here (here it is this host's init, with another start time).
    owner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                              sys.executable, "-c", OWNER, cluster],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        name = owner.stdout.readline().strip()
        assert name, "the owner did not start"
        assert cleanup_stale_segments(cluster) == []
        survived = os.path.exists(os.path.join(SHM_DIR, name))
        print(f"live segment of a process in another pid namespace survives cleanup: {survived}")
        assert survived
    finally:
        os.kill(owner.pid, signal.SIGKILL)   # --kill-child: the owner dies with unshare
        owner.wait(10)
        owner.stdout.close()
    # Once its owner is gone, the same file is cleaned up.
    for _ in range(100):
        removed = cleanup_stale_segments(cluster)
        if removed:
            break
        time.sleep(0.05)
    assert removed == [name]

"""Two processes: A owns a segment and its data server, B (this test) writes and reads it over
shm and over tcp (forced by giving A another host id), byte-exact as A sees it; then A is
killed: B's transfers fail cleanly within their deadline and A's shared memory is cleaned up.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import uvloop
import xxhash

from kvpool_client.segments import SHM_DIR, cleanup_stale_segments, host_id
from kvpool_client.transfer import ShmTransport, TcpTransport, choose
from kvpool_wire import capability
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op, Placement, SegmentInfo

SEGMENT_BYTES = 32 << 20

_OWNER = """
import json, os, sys, xxhash
from kvpool_client.segments import LocalSegment, host_id
from kvpool_client.transfer import DataServer
segment = LocalSegment.create(sys.argv[1], "owner-a", 0, int(sys.argv[2]))
key = os.urandom(32)
segment.stamp_owner(key)  # as a client does with the key the master gave it
server = DataServer({segment.segment_id: segment}, key)
server.start()
info = segment.describe(host_id(), server.endpoint)
print(json.dumps({"key": key.hex(), "segment_id": info.segment_id, "client_id": info.client_id,
                  "size_bytes": info.size_bytes, "host_id": info.host_id,
                  "shm_name": info.shm_name, "tcp_endpoint": info.tcp_endpoint}), flush=True)
for line in sys.stdin:  # "digest OFFSET LENGTH" -> xxh3 of those bytes as this process sees them
    _, offset, length = line.split()
    view = segment.buffer[int(offset):int(offset) + int(length)]
    print(xxhash.xxh3_128_hexdigest(view), flush=True)
    view.release()
server.close()
segment.close()
"""


@dataclass
class Owner:
    """Process A."""

    proc: subprocess.Popen[str]
    info: SegmentInfo
    key: bytes

    def digest(self, offset: int, length: int) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"digest {offset} {length}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def placement(self, offset: int, length: int, op: Op) -> Placement:
        expiry_ms = int(time.time() * 1000) + 60_000
        return Placement(self.info.segment_id, offset, length, expiry_ms,
                         capability.sign(self.key, self.info.segment_id, offset, length, op,
                                         expiry_ms))


@contextmanager
def owner_process(cluster: str, host_override: str | None) -> Iterator[Owner]:
    env = dict(os.environ)
    env.pop("KVPOOL_HOST_ID", None)
    if host_override:
        env["KVPOOL_HOST_ID"] = host_override
    proc = subprocess.Popen([sys.executable, "-c", _OWNER, cluster, str(SEGMENT_BYTES)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        described = json.loads(proc.stdout.readline())
        key = bytes.fromhex(described.pop("key"))
        # What GetSegments hands a mapper: the descriptor with the owner's proof.
        proof = capability.ownership_proof(key, described["segment_id"], described["shm_name"],
                                           described["size_bytes"])
        yield Owner(proc, SegmentInfo(**described, ownership_proof=proof), key)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        cleanup_stale_segments(cluster)


@pytest.fixture
def cluster() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_process_b_writes_and_reads_process_a_byte_exact(cluster: str, path: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_HOST_ID", raising=False)
    with owner_process(cluster, "elsewhere" if path == "tcp" else None) as owner:
        objects = [os.urandom(size) for size in (1, 4096, 1 << 20, (3 << 20) + 7, 16 << 20)]
        offsets = [0]
        for data in objects[:-1]:
            offsets.append(offsets[-1] + len(data))

        async def main() -> None:
            shm, tcp = ShmTransport(), TcpTransport()
            try:
                transport = choose(owner.info, host_id(), shm=shm, tcp=tcp)
                assert transport is (shm if path == "shm" else tcp)
                writes = []
                for offset, data in zip(offsets, objects, strict=True):
                    view = memoryview(data)
                    half = len(data) // 2
                    writes.append((owner.info, owner.placement(offset, len(data), Op.WRITE),
                                   [view[:half], view[half:]]))
                assert await transport.write_batch(writes) == [Status.OK] * len(objects)
                for offset, data in zip(offsets, objects, strict=True):
                    assert owner.digest(offset, len(data)) == xxhash.xxh3_128_hexdigest(data)
                outs = [bytearray(len(data)) for data in objects]
                reads = [(owner.info, owner.placement(offset, len(out), Op.READ),
                          [memoryview(out)]) for offset, out in zip(offsets, outs, strict=True)]
                assert await transport.read_batch(reads) == [Status.OK] * len(objects)
                assert [bytes(out) for out in outs] == objects
            finally:
                await shm.close()
                await tcp.close()

        uvloop.run(main())


def test_killed_owner_fails_transfers_cleanly_and_its_shm_is_cleaned_up(cluster: str) -> None:
    with owner_process(cluster, "elsewhere") as owner:
        shm_path = os.path.join(SHM_DIR, owner.info.shm_name)

        async def main() -> float:
            tcp = TcpTransport(timeout_s=2.0)
            try:
                out = [memoryview(bytearray(1 << 20))]
                await tcp.read(owner.info, owner.placement(0, 1 << 20, Op.READ), out)
                reads = [asyncio.ensure_future(
                    tcp.read(owner.info, owner.placement(0, 1 << 20, Op.READ),
                             [memoryview(bytearray(1 << 20))])) for _ in range(20)]
                started = time.monotonic()
                os.kill(owner.proc.pid, signal.SIGKILL)
                owner.proc.wait(10)
                outcomes = await asyncio.gather(*reads, return_exceptions=True)
                for outcome in outcomes:  # finished before the kill, or failed cleanly
                    assert outcome is None or (isinstance(outcome, KVPoolError) and
                                               outcome.status in (Status.TRANSFER_FAILED,
                                                                  Status.TIMEOUT))
                with pytest.raises(KVPoolError) as err:
                    await tcp.read(owner.info, owner.placement(0, 8, Op.READ),
                                   [memoryview(bytearray(8))])
                assert err.value.status == Status.TRANSFER_FAILED
                return time.monotonic() - started
            finally:
                await tcp.close()

        elapsed_s = uvloop.run(main())
        print(f"transfers to a killed owner finished or failed within {elapsed_s:.2f} s")
        assert elapsed_s < 5.0
        assert os.path.exists(shm_path)  # a SIGKILL leaves the shared memory behind ...
        assert cleanup_stale_segments(cluster) == [owner.info.shm_name]  # ... until cleanup
        assert not os.path.exists(shm_path)

"""Local segments: POSIX shared memory, mode 0600, pre-faulted, unlinked on close, and shared
memory of dead processes removed by cleanup_stale_segments (with real child processes)."""

from __future__ import annotations

import mmap
import os
import signal
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from kvpool_client.segments import (
    HEADER_BYTES,
    SHM_DIR,
    LocalSegment,
    cleanup_stale_segments,
    host_id,
    shm_name_for,
)
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Tier


@pytest.fixture
def cluster() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def segment(cluster: str) -> Iterator[LocalSegment]:
    seg = LocalSegment.create(cluster, "client-a", 0, 8 << 20)
    try:
        yield seg
    finally:
        seg.close()


def _rss_bytes_of_mapping(address: int) -> int:
    """Resident bytes of the mapping starting at ``address``, from /proc/self/smaps."""
    start = f"{address:x}-"
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        lines = f.read().splitlines()
    for index, line in enumerate(lines):
        if line.startswith(start):
            for detail in lines[index + 1:]:
                if detail.startswith("Rss:"):
                    return int(detail.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def test_segment_file_is_0600_owned_by_user(segment: LocalSegment) -> None:
    info = os.stat(os.path.join(SHM_DIR, segment.shm_name))
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.getuid()
    assert info.st_size == segment.size_bytes + HEADER_BYTES and segment.size_bytes == 8 << 20


def test_segment_name_carries_cluster_client_index_and_owner(cluster: str) -> None:
    with LocalSegment.create(cluster, "odd/client:id", 3, 4096) as seg:
        parts = seg.shm_name.split(".")
        assert parts[0] == "kvpool" and parts[1] == cluster
        assert "/" not in seg.shm_name and ":" not in seg.shm_name
        assert parts[3] == "3" and parts[4] == str(os.getpid())
        assert seg.segment_id == "odd/client:id-seg3"
    # sanitised names of different ids never collide
    assert shm_name_for(cluster, "a:b", 0) != shm_name_for(cluster, "a_b", 0)


#: Pages a host's proactive reclaim may have unmapped from a fresh segment by the time it is
#: looked at (DAMON's ``pageout`` scheme unmaps cold pages of tmpfs too, even without swap).
RECLAIMED_PAGES = 16


def test_segment_is_prefaulted_at_creation(segment: LocalSegment) -> None:
    # Every page is already mapped into this process: resident before any byte was written
    # (without the pre-fault only the header page would be).
    mapped_bytes = _rss_bytes_of_mapping(segment.address)
    assert mapped_bytes >= segment.size_bytes + HEADER_BYTES - RECLAIMED_PAGES * mmap.PAGESIZE
    allocated_bytes = os.stat(os.path.join(SHM_DIR, segment.shm_name)).st_blocks * 512
    assert allocated_bytes >= segment.size_bytes


def test_buffer_is_writable_and_zeroed(segment: LocalSegment) -> None:
    view = segment.buffer
    assert not view.readonly and view.nbytes == segment.size_bytes
    assert bytes(view[:4096]) == bytes(4096)
    view[100:105] = b"hello"
    assert bytes(segment.buffer[100:105]) == b"hello"


def test_close_unlinks_and_is_idempotent(cluster: str) -> None:
    seg = LocalSegment.create(cluster, "client-a", 1, 4096)
    path = os.path.join(SHM_DIR, seg.shm_name)
    assert os.path.exists(path)
    seg.close()
    assert not os.path.exists(path)
    assert seg.closed
    seg.close()
    with pytest.raises(KVPoolError) as err:
        _ = seg.buffer
    assert err.value.status == Status.SEGMENT_NOT_FOUND


def test_close_with_a_live_view_unlinks_without_crashing(cluster: str) -> None:
    seg = LocalSegment.create(cluster, "client-a", 2, 4096)
    held = seg.buffer[0:16]
    seg.close()  # the mapping stays until `held` goes; using it must not crash
    held[0:1] = b"x"
    assert bytes(held[0:1]) == b"x"
    assert not os.path.exists(os.path.join(SHM_DIR, seg.shm_name))
    held.release()


def test_create_twice_and_bad_sizes_are_refused(segment: LocalSegment, cluster: str) -> None:
    with pytest.raises(KVPoolError) as err:
        LocalSegment.create(cluster, "client-a", 0, 4096)
    assert err.value.status == Status.SEGMENT_ALREADY_EXISTS
    for size, index in ((0, 1), (-1, 1), (4096, -1)):
        with pytest.raises(KVPoolError) as err:
            LocalSegment.create(cluster, "client-a", index, size)
        assert err.value.status == Status.INVALID_ARGUMENT


def test_describe_gives_what_peers_need(segment: LocalSegment) -> None:
    info = segment.describe("host-1", "127.0.0.1:5000")
    assert (info.segment_id, info.client_id, info.size_bytes, info.tier) == (
        segment.segment_id, "client-a", segment.size_bytes, Tier.DRAM)
    assert (info.host_id, info.shm_name, info.tcp_endpoint) == (
        "host-1", segment.shm_name, "127.0.0.1:5000")


def test_host_id_is_boot_id_and_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPOOL_HOST_ID", raising=False)
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
        boot_id = f.read().strip()
    assert host_id().startswith(boot_id + ":")
    assert host_id() == host_id()
    monkeypatch.setenv("KVPOOL_HOST_ID", "forced-elsewhere")
    assert host_id() == "forced-elsewhere"


_CHILD = """
import sys
from kvpool_client.segments import LocalSegment
seg = LocalSegment.create(sys.argv[1], sys.argv[2], 0, 1 << 20)
print(seg.shm_name, flush=True)
if sys.argv[3] == "wait":
    sys.stdin.read()
import os
os._exit(0)  # no close: the shared memory stays behind, as after a crash
"""


def _start_child(cluster: str, client: str, mode: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, cluster, client, mode],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def test_cleanup_removes_only_segments_of_dead_owners(cluster: str,
                                                      segment: LocalSegment) -> None:
    dead, dead_name = _start_child(cluster, "dead", "exit")
    alive, alive_name = _start_child(cluster, "alive", "wait")
    other, other_name = _start_child(cluster + "-other", "dead", "exit")
    foreign = os.path.join(SHM_DIR, f"kvpool.{cluster}.not-ours")
    try:
        with open(foreign, "wb"):
            pass
        dead.wait(10)  # reaped: the pid is gone
        other.wait(10)
        assert os.path.exists(os.path.join(SHM_DIR, dead_name))
        assert cleanup_stale_segments(cluster) == [dead_name]
        assert not os.path.exists(os.path.join(SHM_DIR, dead_name))
        for kept in (alive_name, segment.shm_name):  # live owners keep theirs
            assert os.path.exists(os.path.join(SHM_DIR, kept))
        assert os.path.exists(os.path.join(SHM_DIR, other_name))  # another cluster
        assert os.path.exists(foreign)  # not our naming pattern
        assert cleanup_stale_segments(cluster) == []
    finally:
        _stop(dead)
        _stop(alive)
        _stop(other)
        for name in (alive_name, other_name):
            if name:
                with_path = os.path.join(SHM_DIR, name)
                if os.path.exists(with_path):
                    os.unlink(with_path)
        if os.path.exists(foreign):
            os.unlink(foreign)
    assert cleanup_stale_segments(cluster) == []


def test_cleanup_treats_a_killed_unreaped_owner_as_dead(cluster: str) -> None:
    proc, name = _start_child(cluster, "zombie", "wait")
    try:
        assert cleanup_stale_segments(cluster) == []  # still running
        os.kill(proc.pid, signal.SIGKILL)
        # Wait until it has died but leave it unreaped: a zombie still owns its pid.
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert os.path.exists(f"/proc/{proc.pid}")
        assert cleanup_stale_segments(cluster) == [name]
    finally:
        _stop(proc)


def test_cleanup_ignores_a_reused_pid(cluster: str) -> None:
    # Same pid as a live process (this one) but another start time: the owner is gone.
    my_name = shm_name_for(cluster, "reused", 0)
    start = int(my_name.rsplit(".", 1)[1])
    stale = my_name.rsplit(".", 1)[0] + f".{start + 1}"
    path = os.path.join(SHM_DIR, stale)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        assert cleanup_stale_segments(cluster) == [stale]
    finally:
        if os.path.exists(path):
            os.unlink(path)

"""ShmTransport: byte-exact scatter-gather copies into and out of a segment mapped by name,
bounds and argument checks that change nothing, remapping, and the parallel copy helpers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import xxhash

from kvpool_client.segments import SHM_DIR, LocalSegment
from kvpool_client.transfer import ShmTransport, choose
from kvpool_client.transfer.copy import ParallelCopier, split_by_bytes
from kvpool_wire.capability import ownership_proof
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, SegmentInfo

SEGMENT_BYTES = 8 << 20
KEY = b"k" * 32


def owned(segment: LocalSegment, key: bytes = KEY) -> SegmentInfo:
    """The owner stamps ``segment`` with its key; return the descriptor a mapper gets from the
    master (with the proof the master derives from the owner's key)."""
    segment.stamp_owner(KEY)
    return dataclasses.replace(segment.describe("this-host"), ownership_proof=ownership_proof(
        key, segment.segment_id, segment.shm_name, segment.size_bytes))


@pytest.fixture
def segment() -> Iterator[LocalSegment]:
    seg = LocalSegment.create(f"test-{uuid.uuid4().hex[:12]}", "owner", 0, SEGMENT_BYTES)
    try:
        seg.buffer[:] = os.urandom(SEGMENT_BYTES)
        yield seg
    finally:
        seg.close()


@pytest.fixture
def info(segment: LocalSegment) -> SegmentInfo:
    return owned(segment)


@pytest.fixture
async def shm() -> AsyncIterator[ShmTransport]:
    # No local segments given: the segment is mapped by name, as a peer process would.
    transport = ShmTransport(copier=ParallelCopier(num_threads=2, inline_max_bytes=64 << 10))
    try:
        yield transport
    finally:
        await transport.close()


def _digest(segment: LocalSegment) -> str:
    return xxhash.xxh3_128_hexdigest(segment.buffer)


def _place(info: SegmentInfo, offset: int, length: int) -> Placement:
    return Placement(info.segment_id, offset, length)


async def test_write_then_read_scatter_gather_byte_exact(segment: LocalSegment,
                                                         info: SegmentInfo,
                                                         shm: ShmTransport) -> None:
    data = os.urandom(300_000)
    regions = [memoryview(data)[:1], memoryview(data)[1:70_001], memoryview(data)[70_001:]]
    await shm.write(info, _place(info, 12_345, len(data)), regions)
    assert bytes(segment.buffer[12_345:12_345 + len(data)]) == data
    out = bytearray(len(data))
    view = memoryview(out)
    await shm.read(info, _place(info, 12_345, len(data)),
                   [view[:99_999], view[99_999:100_000], view[100_000:]])
    assert bytes(out) == data
    assert shm.num_mappings == 1


async def test_large_batch_uses_threads_and_stays_byte_exact(segment: LocalSegment,
                                                             info: SegmentInfo,
                                                             shm: ShmTransport) -> None:
    sizes = [1 << 20, 3 << 20, 4096, 1, 2 << 20]
    datas = [os.urandom(size) for size in sizes]
    offsets = [0]
    for size in sizes[:-1]:
        offsets.append(offsets[-1] + size)
    items = [(info, _place(info, off, len(d)), [memoryview(d)])
             for off, d in zip(offsets, datas, strict=True)]
    assert await shm.write_batch(items) == [Status.OK] * len(items)
    outs = [bytearray(size) for size in sizes]
    read_items = [(info, _place(info, off, len(o)), [memoryview(o)])
                  for off, o in zip(offsets, outs, strict=True)]
    assert await shm.read_batch(read_items) == [Status.OK] * len(items)
    assert [bytes(o) for o in outs] == datas


async def test_regions_may_be_any_contiguous_buffer(segment: LocalSegment, info: SegmentInfo,
                                                    shm: ShmTransport) -> None:
    import numpy as np

    array = np.arange(1024, dtype=np.float32)  # format 'f', 4096 bytes
    await shm.write(info, _place(info, 0, array.nbytes), [memoryview(array)])
    back = np.zeros(1024, dtype=np.float32)
    await shm.read(info, _place(info, 0, back.nbytes), [memoryview(back)])
    assert (back == array).all()


@pytest.mark.parametrize(("offset", "length"), [
    (SEGMENT_BYTES - 10, 11), (SEGMENT_BYTES, 1), (-1, 10), (0, 0), (2**63, 1)])
async def test_out_of_bounds_is_refused_and_changes_nothing(segment: LocalSegment,
                                                            info: SegmentInfo, shm: ShmTransport,
                                                            offset: int, length: int) -> None:
    before = _digest(segment)
    with pytest.raises(KVPoolError) as err:
        await shm.write(info, _place(info, offset, length), [memoryview(bytes(max(length, 0)))])
    assert err.value.status == Status.INVALID_ARGUMENT
    assert _digest(segment) == before


async def test_a_segment_claimed_larger_than_its_file_is_not_mapped(
        segment: LocalSegment, info: SegmentInfo, shm: ShmTransport) -> None:
    lying = dataclasses.replace(info, size_bytes=2 * SEGMENT_BYTES)
    before = _digest(segment)
    with pytest.raises(KVPoolError) as err:
        await shm.write(lying, _place(lying, SEGMENT_BYTES, 4096), [memoryview(bytes(4096))])
    assert err.value.status == Status.PERMISSION_DENIED
    assert _digest(segment) == before


async def test_bad_arguments_are_refused_per_item(segment: LocalSegment, info: SegmentInfo,
                                                  shm: ShmTransport) -> None:
    before = _digest(segment)
    good = bytearray(4096)
    items = [
        (info, _place(info, 0, 4096), [memoryview(bytes(4095))]),  # size mismatch
        (info, Placement("other-seg", 0, 4096), [memoryview(bytes(4096))]),  # wrong segment
        (info, _place(info, 0, 4096), [memoryview(good)]),  # fine
    ]
    assert await shm.write_batch(items) == [Status.INVALID_ARGUMENT, Status.INVALID_ARGUMENT,
                                            Status.OK]
    assert _digest(segment) != before  # only the good item wrote
    assert bytes(segment.buffer[:4096]) == bytes(good)
    with pytest.raises(KVPoolError) as err:  # a read needs writable regions
        await shm.read(info, _place(info, 0, 4096), [memoryview(bytes(4096))])
    assert err.value.status == Status.INVALID_ARGUMENT
    with pytest.raises(KVPoolError) as err:  # non-contiguous region
        await shm.write(info, _place(info, 0, 2048), [memoryview(bytes(4096))[::2]])
    assert err.value.status == Status.INVALID_ARGUMENT


async def test_unknown_or_foreign_shm_names_are_refused(info: SegmentInfo,
                                                        shm: ShmTransport) -> None:
    missing = dataclasses.replace(info, shm_name=info.shm_name + "0")
    with pytest.raises(KVPoolError) as err:
        await shm.read(missing, _place(info, 0, 16), [memoryview(bytearray(16))])
    assert err.value.status == Status.SEGMENT_NOT_FOUND
    for bad_name in ("../etc/passwd", "not-kvpool", "kvpool.x/../../y", ""):
        bad = dataclasses.replace(info, shm_name=bad_name)
        with pytest.raises(KVPoolError) as err:
            await shm.read(bad, _place(info, 0, 16), [memoryview(bytearray(16))])
        assert err.value.status == Status.INVALID_ARGUMENT


async def test_remount_under_another_name_remaps(segment: LocalSegment, info: SegmentInfo,
                                                 shm: ShmTransport) -> None:
    out = bytearray(8)
    await shm.read(info, _place(info, 0, 8), [memoryview(out)])
    assert bytes(out) == bytes(segment.buffer[:8])
    other = LocalSegment.create(f"test-{uuid.uuid4().hex[:12]}", "owner", 0, SEGMENT_BYTES)
    try:
        other.buffer[:8] = b"remount!"
        remounted = owned(other)
        await shm.read(remounted, _place(info, 0, 8), [memoryview(out)])
        assert bytes(out) == b"remount!"
        assert shm.num_mappings == 1
    finally:
        other.close()


async def test_vanished_segment_is_unmapped_and_then_not_found(info: SegmentInfo) -> None:
    transport = ShmTransport(recheck_interval_s=0.0)
    try:
        await transport.read(info, _place(info, 0, 8), [memoryview(bytearray(8))])
        os.unlink(os.path.join(SHM_DIR, info.shm_name))  # as when the owner closed it
        with pytest.raises(KVPoolError) as err:
            await transport.read(info, _place(info, 0, 8), [memoryview(bytearray(8))])
        assert err.value.status == Status.SEGMENT_NOT_FOUND
        assert transport.num_mappings == 0
    finally:
        await transport.close()


async def test_local_segments_use_their_own_mapping(segment: LocalSegment,
                                                    info: SegmentInfo) -> None:
    transport = ShmTransport({segment.segment_id: segment})
    try:
        await transport.write(info, _place(info, 8, 4), [memoryview(b"mine")])
        assert bytes(segment.buffer[8:12]) == b"mine"
    finally:
        await transport.close()


async def test_forget_and_close(info: SegmentInfo, shm: ShmTransport) -> None:
    await shm.read(info, _place(info, 0, 8), [memoryview(bytearray(8))])
    shm.forget(info.segment_id)
    assert shm.num_mappings == 0
    await shm.close()
    with pytest.raises(KVPoolError) as err:
        await shm.read(info, _place(info, 0, 8), [memoryview(bytearray(8))])
    assert err.value.status == Status.UNAVAILABLE


async def test_cancelled_copy_keeps_the_mapping_until_threads_finish(
        segment: LocalSegment, info: SegmentInfo, shm: ShmTransport) -> None:
    data = os.urandom(4 << 20)
    task = asyncio.ensure_future(shm.write(info, _place(info, 0, len(data)),
                                           [memoryview(data)]))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    shm.forget(info.segment_id)  # unmapped only once the threads are done: no crash
    await shm.read(info, _place(info, 0, 16), [memoryview(bytearray(16))])


def test_choose_picks_shm_on_the_same_host_unless_forced(info: SegmentInfo) -> None:
    shm, tcp = ShmTransport(), object()
    assert choose(info, "this-host", shm=shm, tcp=tcp) is shm  # type: ignore[arg-type]
    assert choose(info, "this-host", True, shm=shm, tcp=tcp) is tcp  # type: ignore[arg-type]
    assert choose(info, "other-host", shm=shm, tcp=tcp) is tcp  # type: ignore[arg-type]
    no_shm = dataclasses.replace(info, shm_name="")
    assert choose(no_shm, "this-host", shm=shm, tcp=tcp) is tcp  # type: ignore[arg-type]


async def test_choose_without_instances_shares_them_per_loop(info: SegmentInfo) -> None:
    first = choose(info, "this-host")
    assert choose(info, "this-host") is first
    assert isinstance(first, ShmTransport)
    await first.close()
    assert choose(info, "this-host") is not first  # a closed one is replaced
    from kvpool_client.transfer import close_shared_transports

    await close_shared_transports()


def test_split_by_bytes_balances_and_preserves_bytes() -> None:
    src = bytes(range(256)) * 4096  # 1 MiB
    dst = bytearray(len(src))
    s, d = memoryview(src), memoryview(dst)
    copies = [(d[:1000], s[:1000]), (d[1000:], s[1000:])]
    parts = split_by_bytes(copies, 2)
    assert len(parts) == 2
    sizes = [sum(x.nbytes for x, _ in part) for part in parts]
    assert sum(sizes) == len(src) and abs(sizes[0] - sizes[1]) <= 1
    for part in parts:
        for target, source in part:
            target[:] = source
    assert bytes(dst) == src
    assert split_by_bytes([], 2) == []


def test_copy_makes_a_share_on_the_calling_thread() -> None:
    import threading

    from kvpool_client.transfer import copy as copy_module

    copier = ParallelCopier(num_threads=2, inline_max_bytes=64 << 10)
    src = os.urandom(3 << 20)
    dst = bytearray(len(src))
    s, d = memoryview(src), memoryview(dst)
    copies = [(d[:1 << 20], s[:1 << 20]), (d[1 << 20:], s[1 << 20:])]
    threads: list[int] = []
    original = copy_module.copy_nogil

    def recording(pairs: Any) -> None:
        threads.append(threading.get_ident())
        original(pairs)

    copy_module.copy_nogil = recording
    try:
        copier.copy(copies)
    finally:
        copy_module.copy_nogil = original
        copier.close()
    assert bytes(dst) == src
    assert threading.get_ident() in threads and len(set(threads)) == 2


def test_copy_raises_a_helpers_failure_after_every_part_ended() -> None:
    copier = ParallelCopier(num_threads=2, inline_max_bytes=64 << 10)
    src = os.urandom(2 << 20)
    dst = bytearray(1 << 20)
    read_only = bytes(1 << 20)  # the helper's destination: the copy refuses to write it
    copies = [(memoryview(dst), memoryview(src)[:1 << 20]),
              (memoryview(read_only), memoryview(src)[1 << 20:])]
    try:
        with pytest.raises((ValueError, TypeError)):
            copier.copy(copies)
    finally:
        copier.close()
    assert bytes(dst) == src[:1 << 20]  # the caller's own share was copied in full
    assert read_only == bytes(1 << 20)


async def test_shm_transport_copy_batch_on_the_calling_thread_stays_byte_exact(
        segment: LocalSegment, info: SegmentInfo) -> None:
    transport = ShmTransport(copier=ParallelCopier(num_threads=2, inline_max_bytes=64 << 10))
    try:
        data = os.urandom(5 << 20)
        assert transport.copy_batch([(info, _place(info, 4096, len(data)), [memoryview(data)])],
                                    writing=True) == [Status.OK]
        assert bytes(segment.buffer[4096:4096 + len(data)]) == data
        out = bytearray(len(data))
        assert transport.copy_batch([(info, _place(info, 4096, len(data)), [memoryview(out)])],
                                    writing=False) == [Status.OK]
        assert bytes(out) == data
        bad = _place(info, info.size_bytes - 10, 4096)  # out of bounds: refused alone
        assert transport.copy_batch([(info, bad, [memoryview(bytearray(4096))])],
                                    writing=True) == [Status.INVALID_ARGUMENT]
    finally:
        await transport.close()


def test_copy_waits_for_started_helpers_when_a_later_one_cannot_start() -> None:
    """A helper that could not be started fails the copy, but only once the helpers already
    running have finished: nobody copies into a mapping after the caller let it go."""
    import concurrent.futures
    import threading

    from kvpool_client.transfer import copy as copy_module

    finished = threading.Event()
    real = concurrent.futures.ThreadPoolExecutor(1)

    def slow_copy(pairs: Any) -> None:
        threading.Event().wait(0.2)
        copy_module.copy_nogil(pairs)
        finished.set()

    class OneHelperOnly:
        submitted = 0

        def submit(self, fn: Any, part: Any) -> Any:
            self.submitted += 1
            if self.submitted > 1:
                raise RuntimeError("cannot schedule new futures after shutdown")
            return real.submit(slow_copy, part)

    copier = ParallelCopier(num_threads=3, inline_max_bytes=64 << 10)
    copier._executor = OneHelperOnly()  # type: ignore[assignment]
    src = os.urandom(3 << 20)
    dst = bytearray(len(src))
    try:
        with pytest.raises(RuntimeError):
            copier.copy([(memoryview(dst), memoryview(src))])
        assert finished.is_set()
    finally:
        real.shutdown()


async def test_a_descriptor_naming_another_owners_memory_is_never_mapped(
        segment: LocalSegment, info: SegmentInfo, shm: ShmTransport) -> None:
    # A segment mounted by someone else (its own key, so its own proof) but naming this
    # segment's shared memory, or claiming another size: refused before any byte moves.
    before = bytes(segment.buffer[:64])
    impostor = dataclasses.replace(info, segment_id="fake-seg0", ownership_proof=ownership_proof(
        b"i" * 32, "fake-seg0", info.shm_name, info.size_bytes))
    unproven = dataclasses.replace(info, segment_id="bare-seg0", ownership_proof=b"")
    larger = dataclasses.replace(info, segment_id="big-seg0", size_bytes=info.size_bytes + 4096)
    for fake in (impostor, unproven, larger):
        with pytest.raises(KVPoolError) as error:
            await shm.write(fake, _place(fake, 0, 64), [memoryview(b"\xee" * 64)])
        assert error.value.status == Status.PERMISSION_DENIED
    assert bytes(segment.buffer[:64]) == before
    # The owner's own descriptor maps, and its header page stays out of reach.
    with pytest.raises(KVPoolError):
        await shm.write(info, _place(info, info.size_bytes, 8), [memoryview(b"x" * 8)])
    await shm.write(info, _place(info, 0, 64), [memoryview(b"\x01" * 64)])
    assert bytes(segment.buffer[:64]) == b"\x01" * 64

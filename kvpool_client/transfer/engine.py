"""The engine transport: one-sided transfers through a transfer engine (Mooncake's
``mooncake.engine.TransferEngine``: RDMA, Ascend direct / HCCL, NVLink, its own TCP, ...).

Rules of this file:
- One engine per client, built by ``open_engine`` or handed in by the caller (initialised with
  the ``P2PHANDSHAKE`` metadata, as MindIE and vllm-ascend build theirs). Its session id
  ``"host:rpc_port"`` and each segment's base address are what ``MountSegment`` advertises; the
  master stays the only coordinator and never touches bytes.
- The engine touches registered memory only: the client's segments, one staging buffer, and
  ranges the caller registered (``register``; device memory included). A host region outside
  every registered range travels through the staging buffer, one batch at a time holding it;
  an ``AddressRange`` region (memory known only by address, e.g. a device tensor) must lie in
  registered memory and travels straight from or to it, never through host memory here.
- Every item is checked (``base.check_item``) before any byte moves. The items of one call go
  to each peer in one ``batch_transfer_sync_*`` call; the engine answers per call, so a failed
  call fails each of its items with TRANSFER_FAILED: the driver then revokes the writes and
  reports the reads failed. Nothing else is inferred from a failure (no partial success).
- Calls block; any thread may call. The asyncio driver runs them on a worker thread.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib
import logging
import mmap
import threading
from collections.abc import Sequence
from typing import Any

from kvpool_client.buffers import address_of
from kvpool_client.core.regions import AddressRange
from kvpool_client.transfer.base import Item, byte_views, check_range
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, SegmentInfo

logger = logging.getLogger(__name__)

#: the staging buffer when ``local_buffer_size`` is 0
DEFAULT_STAGING_BYTES = 64 << 20
#: protocols a transfer engine knows (``protocol`` in the config chooses the engine's one)
ENGINE_PROTOCOLS = ("tcp", "rdma", "ascend", "nvlink", "efa", "hip", "cxl", "barex")


def load_engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class. Raises KVPoolError INVALID_ARGUMENT when no real
    engine is installed (kvpool's drop-in stand-in does not count: it moves no bytes)."""
    try:
        module = importlib.import_module("mooncake.engine")
    except Exception as exc:  # ImportError, or a native library that does not load
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"the engine transport needs Mooncake's TransferEngine (pip install "
                          f"mooncake-transfer-engine, -non-cuda or -npu): {exc}") from None
    cls = getattr(module, "TransferEngine", None)
    if cls is None or not hasattr(cls, "batch_transfer_sync_write"):
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          "mooncake.engine.TransferEngine here is kvpool's drop-in stand-in, "
                          "not a transfer engine: install kvpool-mooncake-store beside the real "
                          "mooncake-transfer-engine wheel instead of kvpool-mooncake")
    return cls


def open_engine(host: str, protocol: str, device_name: str = "") -> Any:
    """A new engine for this process, initialised for peer-to-peer handshakes on ``host``.
    Raises KVPoolError INVALID_ARGUMENT (no engine installed) or TRANSFER_FAILED (it would not
    start, e.g. no device for ``protocol``)."""
    engine = load_engine_class()()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise KVPoolError(Status.TRANSFER_FAILED,
                          f"TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {protocol!r}, "
                          f"{device_name!r}) returned {rc}")
    return engine


class _Ranges:
    """Registered address ranges, looked up by containment."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, address: int, nbytes: int) -> None:
        at = bisect.bisect_left(self._starts, address)
        self._starts.insert(at, address)
        self._ends.insert(at, address + nbytes)

    def remove(self, address: int) -> bool:
        at = bisect.bisect_left(self._starts, address)
        if at == len(self._starts) or self._starts[at] != address:
            return False
        del self._starts[at], self._ends[at]
        return True

    def covers(self, address: int, nbytes: int) -> bool:
        at = bisect.bisect_right(self._starts, address) - 1
        while at >= 0:
            if address + nbytes <= self._ends[at]:
                return True
            at -= 1
        return False


class EngineTransport:
    """Moves items one-sidedly through a transfer engine; see the module rules."""

    def __init__(self, engine: Any, host: str, *,
                 staging_bytes: int = DEFAULT_STAGING_BYTES) -> None:
        self.engine = engine
        self.session_id = f"{host}:{engine.get_rpc_port()}"
        self._lock = threading.Lock()  # the registry; the staging buffer has its own
        self._ranges = _Ranges()
        self._staging_lock = threading.Lock()
        self._staging_map = mmap.mmap(-1, staging_bytes)
        self._staging = memoryview(self._staging_map)
        self._staging_address = ctypes.addressof(ctypes.c_char.from_buffer(self._staging_map))
        self.register(self._staging_address, staging_bytes)

    # -- memory -----------------------------------------------------------------------------------

    def register(self, address: int, nbytes: int) -> None:
        """Let the engine reach ``[address, address + nbytes)`` (host or device memory).
        Raises KVPoolError TRANSFER_FAILED when the engine refuses."""
        rc = self.engine.register_memory(address, nbytes)
        if rc != 0:
            raise KVPoolError(Status.TRANSFER_FAILED,
                              f"the engine did not register 0x{address:x}+{nbytes} ({rc})")
        with self._lock:
            self._ranges.add(address, nbytes)

    def unregister(self, address: int) -> None:
        """Withdraw a range registered at ``address`` (nothing when none is)."""
        with self._lock:
            known = self._ranges.remove(address)
        if known:
            self.engine.unregister_memory(address)

    def registered(self, address: int, nbytes: int) -> bool:
        """Whether the engine reaches the whole range in place."""
        return self._ranges.covers(address, nbytes)

    def close(self) -> None:
        """Unregister the staging buffer (the engine itself lives as long as the process:
        Mooncake's engine has no shutdown call)."""
        self.unregister(self._staging_address)
        self._staging.release()
        self._staging_map.close()

    # -- transfers --------------------------------------------------------------------------------

    def write_batch(self, items: Sequence[Item]) -> list[Status]:
        """Write every item; one Status per item."""
        return self._run(items, writing=True)

    def read_batch(self, items: Sequence[Item]) -> list[Status]:
        """Read every item; one Status per item."""
        return self._run(items, writing=False)

    def _run(self, items: Sequence[Item], *, writing: bool) -> list[Status]:
        statuses = [Status.OK] * len(items)
        direct = _Calls()
        staged: list[tuple[int, int, memoryview, int]] = []  # item, remote address, view, bytes
        for index, (info, placement, regions) in enumerate(items):
            try:
                remote = _remote_address(info, placement)
                at = remote
                for region in regions:
                    if isinstance(region, AddressRange):
                        if not self.registered(region.address, region.nbytes):
                            raise KVPoolError(Status.INVALID_ARGUMENT,
                                              f"0x{region.address:x}+{region.nbytes} is not "
                                              "registered with the transfer engine")
                        direct.add(index, info.engine_endpoint, region.address, at,
                                   region.nbytes)
                        at += region.nbytes
                        continue
                    view = byte_views([region], writable=not writing)[0]
                    address = 0 if view.readonly else address_of(view)
                    if address and self.registered(address, view.nbytes):
                        direct.add(index, info.engine_endpoint, address, at, view.nbytes)
                    elif view.nbytes:
                        staged.append((index, at, view, view.nbytes))
                    at += view.nbytes
                if at - remote != placement.length:
                    raise KVPoolError(Status.INVALID_ARGUMENT,
                                      f"regions hold {at - remote} bytes, placement "
                                      f"{placement.length}")
            except KVPoolError as exc:
                statuses[index] = exc.status
                direct.drop(index)
                staged = [s for s in staged if s[0] != index]
        direct.run(self.engine, writing, statuses)
        if staged:
            self._run_staged(items, staged, writing, statuses)
        return statuses

    def _run_staged(self, items: Sequence[Item], staged: list[tuple[int, int, memoryview, int]],
                    writing: bool, statuses: list[Status]) -> None:
        """Move the host regions outside registered memory through the staging buffer, as
        many rounds as it takes."""
        capacity = len(self._staging)
        with self._staging_lock:
            calls = _Calls()
            copies: list[tuple[int, memoryview, int]] = []  # item, caller's view, staging offset
            used = 0
            for index, remote, view, nbytes in staged:
                endpoint = items[index][0].engine_endpoint
                done = 0
                while done < nbytes:
                    if used == capacity:
                        self._flush(calls, copies, writing, statuses)
                        calls, copies, used = _Calls(), [], 0
                    take = min(nbytes - done, capacity - used)
                    part = view[done:done + take]
                    if writing:
                        self._staging[used:used + take] = part
                    copies.append((index, part, used))
                    calls.add(index, endpoint, self._staging_address + used, remote + done, take)
                    used += take
                    done += take
            self._flush(calls, copies, writing, statuses)

    def _flush(self, calls: _Calls, copies: list[tuple[int, memoryview, int]], writing: bool,
               statuses: list[Status]) -> None:
        calls.run(self.engine, writing, statuses)
        if not writing:  # a failed read leaves the caller's buffer as it was
            staging = self._staging
            for index, part, offset in copies:
                if statuses[index] == Status.OK:
                    part[:] = staging[offset:offset + part.nbytes]


class _Calls:
    """Transfers grouped per peer session: (item, local address, remote address, bytes)."""

    def __init__(self) -> None:
        self._by_session: dict[str, list[tuple[int, int, int, int]]] = {}

    def add(self, index: int, session: str, local: int, remote: int, nbytes: int) -> None:
        self._by_session.setdefault(session, []).append((index, local, remote, nbytes))

    def drop(self, index: int) -> None:
        for ops in self._by_session.values():
            ops[:] = [op for op in ops if op[0] != index]

    def run(self, engine: Any, writing: bool, statuses: list[Status]) -> None:
        """One batch call per session; a failed call fails each of its items."""
        call = engine.batch_transfer_sync_write if writing else engine.batch_transfer_sync_read
        for session, ops in self._by_session.items():
            ops = [op for op in ops if statuses[op[0]] == Status.OK]
            if not ops:
                continue
            try:
                rc = call(session, [op[1] for op in ops], [op[2] for op in ops],
                          [op[3] for op in ops])
            except Exception as exc:  # the binding raises for malformed arguments
                logger.warning("engine transfer to %s raised: %s", session, exc)
                rc = -1
            if rc != 0:
                logger.warning("engine %s of %d ranges with %s failed (%s)",
                               "write" if writing else "read", len(ops), session, rc)
                for op in ops:
                    statuses[op[0]] = Status.TRANSFER_FAILED


def _remote_address(info: SegmentInfo, placement: Placement) -> int:
    """Where the placement starts in its owner's engine address space. Raises KVPoolError
    INVALID_ARGUMENT (another segment, out of range) or SEGMENT_NOT_FOUND (no engine there)."""
    if placement.segment_id != info.segment_id:
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"placement on {placement.segment_id!r} given with segment "
                          f"{info.segment_id!r}")
    check_range(placement.offset, placement.length, info.size_bytes)
    if not info.engine_endpoint or not info.engine_base_address:
        raise KVPoolError(Status.SEGMENT_NOT_FOUND,
                          f"segment {info.segment_id} has no transfer-engine endpoint")
    return info.engine_base_address + placement.offset

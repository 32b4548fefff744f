"""One-sided data plane: move an object's bytes between the caller's regions and a placement.

Transport per placement: ``shm`` when the segment's host id is this host's (any process; map
once, copy directly), ``tcp`` otherwise or when forced (the owner's data server). ``choose`` is
that rule; ``TransportRouter`` applies it to whole batches.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Sequence

from kvpool_client.status import Status
from kvpool_client.transfer.base import Item, Regions, Transport
from kvpool_client.transfer.shm import ShmTransport
from kvpool_client.transfer.tcp import DataServer
from kvpool_client.transfer.tcp_client import TcpTransport
from kvpool_client.types import Placement, SegmentInfo

__all__ = ["DataServer", "Item", "Regions", "ShmTransport", "TcpTransport", "Transport",
           "TransportRouter", "choose", "close_shared_transports", "uses_shm"]

_loop_to_shared: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, tuple[ShmTransport, TcpTransport]] = weakref.WeakKeyDictionary()


def uses_shm(segment: SegmentInfo, local_host_id: str, force_tcp: bool = False) -> bool:
    """True when ``segment`` should be reached through shared memory from this host."""
    return not force_tcp and bool(segment.shm_name) and segment.host_id == local_host_id


def choose(segment: SegmentInfo, local_host_id: str, force_tcp: bool = False, *,
           shm: ShmTransport | None = None, tcp: TcpTransport | None = None) -> Transport:
    """Return the transport that reaches ``segment``: shm on the same host unless forced,
    tcp otherwise.

    Without ``shm``/``tcp`` it returns the running event loop's shared instances (created on
    first use, replaced when closed; ``close_shared_transports()`` closes them). Raises
    RuntimeError outside a running event loop in that case.
    """
    if shm is None or tcp is None:
        loop = asyncio.get_running_loop()
        shared = _loop_to_shared.get(loop)
        if shared is None or shared[0].closed or shared[1].closed:
            shared = _loop_to_shared[loop] = (ShmTransport(), TcpTransport())
        shm = shm or shared[0]
        tcp = tcp or shared[1]
    return shm if uses_shm(segment, local_host_id, force_tcp) else tcp


async def close_shared_transports() -> None:
    """Close the running loop's shared transports (those ``choose`` returns by default)."""
    shared = _loop_to_shared.pop(asyncio.get_running_loop(), None)
    if shared is not None:
        for transport in shared:
            await transport.close()


class TransportRouter:
    """A Transport that sends each item through the transport ``choose`` picks for it, so one
    batch may mix segments on this host and elsewhere."""

    def __init__(self, local_host_id: str, *, force_tcp: bool = False,
                 shm: ShmTransport | None = None, tcp: TcpTransport | None = None) -> None:
        self.local_host_id = local_host_id
        self.force_tcp = force_tcp
        self.shm = shm if shm is not None else ShmTransport()
        self.tcp = tcp if tcp is not None else TcpTransport()

    def choose(self, segment: SegmentInfo) -> Transport:
        """Return the transport for ``segment``."""
        return choose(segment, self.local_host_id, self.force_tcp, shm=self.shm, tcp=self.tcp)

    async def write(self, segment: SegmentInfo, placement: Placement, src: Regions) -> None:
        """Write through the chosen transport. Raises KVPoolError (see ShmTransport.write and
        TcpTransport.write)."""
        await self.choose(segment).write(segment, placement, src)

    async def read(self, segment: SegmentInfo, placement: Placement, dst: Regions) -> None:
        """Read through the chosen transport. Raises KVPoolError."""
        await self.choose(segment).read(segment, placement, dst)

    async def write_batch(self, items: Sequence[Item]) -> list[Status]:
        """Write every item, shm and tcp parts concurrently; one Status per item."""
        return await self._batch(items, writing=True)

    async def read_batch(self, items: Sequence[Item]) -> list[Status]:
        """Read every item, shm and tcp parts concurrently; one Status per item."""
        return await self._batch(items, writing=False)

    async def close(self) -> None:
        """Close both transports (idempotent)."""
        await self.shm.close()
        await self.tcp.close()

    async def _batch(self, items: Sequence[Item], *, writing: bool) -> list[Status]:
        index_by_shm: tuple[list[int], list[int]] = ([], [])
        for index, (segment, _, _) in enumerate(items):
            index_by_shm[uses_shm(segment, self.local_host_id, self.force_tcp)].append(index)
        statuses = [Status.INTERNAL_ERROR] * len(items)
        jobs = []
        for transport, indexes in ((self.tcp, index_by_shm[0]), (self.shm, index_by_shm[1])):
            if indexes:
                part = [items[i] for i in indexes]
                run = transport.write_batch(part) if writing else transport.read_batch(part)
                jobs.append((indexes, run))
        results = await asyncio.gather(*(run for _, run in jobs))
        for (indexes, _), part_statuses in zip(jobs, results, strict=True):
            for index, status in zip(indexes, part_statuses, strict=True):
                statuses[index] = status
        return statuses


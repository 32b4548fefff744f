"""One-sided data plane: move an object's bytes between the caller's regions and a placement.

Transport per placement: ``shm`` when the segment's host id is this host's (any process; map
once, copy directly), ``tcp`` otherwise or when forced (the owner's data server). ``uses_shm``
is that rule and ``choose`` returns the transport it picks. ``BlockingTcpTransport`` is the tcp
transport for a caller that moves bytes on its own thread, without an event loop.
"""

from __future__ import annotations

import asyncio
import weakref

from kvpool_client.transfer.base import Item, Regions, Transport
from kvpool_client.transfer.shm import ShmTransport
from kvpool_client.transfer.tcp import DataServer
from kvpool_client.transfer.tcp_blocking import BlockingTcpTransport
from kvpool_client.transfer.tcp_client import TcpTransport
from kvpool_wire.types import SegmentInfo

__all__ = ["BlockingTcpTransport", "DataServer", "Item", "Regions", "ShmTransport", "TcpTransport",
           "Transport", "choose", "close_shared_transports", "uses_shm"]

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

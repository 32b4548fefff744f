"""A ``mooncake.engine.TransferEngine`` facade: what MindIE and vllm-ascend call before ``setup``.

Rules of this file:
- Engines create one TransferEngine per process, ``initialize`` it, read ``get_rpc_port()`` to
  name their segment ``"host:port"``, and hand ``get_engine()`` to every store's ``setup``. Some
  (vllm-ascend) register their KV caches on the engine (``register_memory``) rather than on the
  store. So the engine owns a :class:`RegionRegistry`, and every store set up with its handle
  shares it.
- kvpool moves bytes with its own transports, so the engine runs no server. It holds a bound
  (not listening) socket so that the port it reports is unique on the host while it lives.
- Every call returns Mooncake's integer codes: 0 on success, -600 for bad arguments.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence

from kvpool_client.compat import codes
from kvpool_client.compat.memory import RegionRegistry
from kvpool_client.compat.setup_args import host_of
from kvpool_wire.status import KVPoolError

logger = logging.getLogger(__name__)


class EngineHandle:
    """The opaque object ``get_engine()`` returns; ``setup(..., engine=handle)`` adopts it."""

    def __init__(self, registry: RegionRegistry) -> None:
        self.registry = registry

    def __repr__(self) -> str:
        return f"<kvpool EngineHandle regions={len(self.registry)}>"


class TransferEngine:
    """Mooncake's TransferEngine surface over kvpool: initialize, rpc port, memory registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._registry = RegionRegistry()
        self._handle = EngineHandle(self._registry)
        self._socket: socket.socket | None = None
        self._hostname = ""
        self.protocol = ""
        self.device_name = ""

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str,
                   device_name: str) -> int:
        """Reserve this engine's port on ``local_hostname``; return 0 (-600 for bad arguments).

        Any ``protocol`` Mooncake knows is accepted: kvpool picks shared memory or TCP per peer
        itself, and device memory is reached through the registry's device runtimes.
        """
        for name, value in (("local_hostname", local_hostname),
                            ("metadata_server", metadata_server), ("protocol", protocol),
                            ("device_name", device_name)):
            if not isinstance(value, str):
                logger.error("TransferEngine.initialize: %s must be a string", name)
                return codes.INVALID_PARAMS
        with self._lock:
            if self._socket is not None:
                return codes.OK
            host = host_of(local_hostname) or "127.0.0.1"
            try:
                self._socket = _reserve_port(host)
            except OSError as exc:
                logger.error("TransferEngine.initialize: cannot bind a port on %s: %s", host, exc)
                return codes.INVALID_PARAMS
            self._hostname = host
            self.protocol = protocol
            self.device_name = device_name
        return codes.OK

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str,
                       device_name: str, metadata_type: str = "") -> int:
        """``initialize`` with Mooncake's extra metadata-type argument (ignored)."""
        return self.initialize(local_hostname, metadata_server, protocol, device_name)

    def get_rpc_port(self) -> int:
        """Return the port reserved by ``initialize`` (0 before it)."""
        sock = self._socket
        return sock.getsockname()[1] if sock is not None else 0

    def get_engine(self) -> EngineHandle:
        """Return the handle stores take as ``setup(..., engine=...)``."""
        return self._handle

    def register_memory(self, ptr: int, size: int) -> int:
        """Register ``[ptr, ptr+size)`` for transfers; 0, or -600 when it cannot be used."""
        try:
            self._registry.register(ptr, size)
        except KVPoolError as exc:
            logger.error("register_memory: %s", exc.message)
            return codes.code_of_error(exc)
        return codes.OK

    def unregister_memory(self, ptr: int) -> int:
        """Forget the region registered at ``ptr``; 0, or -600 when there is none."""
        try:
            self._registry.unregister(ptr)
        except KVPoolError as exc:
            logger.error("unregister_memory: %s", exc.message)
            return codes.code_of_error(exc)
        return codes.OK

    def batch_register_memory(self, ptrs: Sequence[int], sizes: Sequence[int]) -> int:
        """Register every (ptr, size); the first failing code, or 0."""
        if len(ptrs) != len(sizes):
            return codes.INVALID_PARAMS
        for ptr, size in zip(ptrs, sizes, strict=True):
            ret = self.register_memory(ptr, size)
            if ret != codes.OK:
                return ret
        return codes.OK

    def batch_unregister_memory(self, ptrs: Sequence[int]) -> int:
        """Forget every region registered at ``ptrs``; the first failing code, or 0."""
        for ptr in ptrs:
            ret = self.unregister_memory(ptr)
            if ret != codes.OK:
                return ret
        return codes.OK

    def close(self) -> None:
        """Release the reserved port and forget every region."""
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None
        self._registry.clear()


def _reserve_port(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
    except OSError:
        sock.close()
        raise
    return sock

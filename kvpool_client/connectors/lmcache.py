"""LMCache remote storage plugin ``kvpool``: a ``ConnectorAdapter`` and its ``RemoteConnector``.

Rules of this file:
- LMCache loads it from its config::

    remote_storage_plugins: ["kvpool"]
    extra_config:
      remote_storage_plugin.kvpool.module_path: kvpool_client.connectors.lmcache
      remote_storage_plugin.kvpool.class_name: KVPoolConnectorAdapter
      remote_storage_plugin.kvpool.master_server_address: "10.0.0.1:50051"   # any client key

  The client config is ``remote_storage_plugin.kvpool.config_path`` (a kvpool/Mooncake JSON),
  else ``KVPOOL_CONFIG_PATH`` / ``MOONCAKE_CONFIG_PATH``; the other
  ``remote_storage_plugin.kvpool.<key>`` entries override its keys.
- This module is imported only by LMCache, so it imports LMCache's base classes directly.
- One LMCache chunk is one object holding exactly the memory object's bytes (no header): reads
  allocate a full chunk from LMCache's CPU backend, read into it in place, and let LMCache
  reshape a shorter (last, partial) chunk, as its own file connector does without chunk
  metadata. Layer-wise mode stores per-layer shapes and is refused.
- The kvpool client is synchronous (its own loop thread); the async methods run its calls in
  the default executor so LMCache's event loop never blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvpool_client.config import ClientConfig
from kvpool_wire.status import KVPoolError, Status

logger = logging.getLogger(__name__)
T = TypeVar("T")

PLUGIN_TYPE = "kvpool"
_LOADER_KEYS = ("module_path", "class_name", "config_path")


def client_config(extra_config: dict[str, Any] | None, plugin_name: str = PLUGIN_TYPE
                  ) -> ClientConfig:
    """Return the client config LMCache's ``extra_config`` describes (see the module doc)."""
    prefix = f"remote_storage_plugin.{plugin_name}."
    entries = {k[len(prefix):]: v for k, v in (extra_config or {}).items()
               if isinstance(k, str) and k.startswith(prefix)}
    overrides = {k: v for k, v in entries.items() if k not in _LOADER_KEYS}
    path = entries.get("config_path")
    if not path:
        return ClientConfig.from_env_with(overrides, source=f"extra_config {prefix}*")
    base = ClientConfig.from_file(path)
    return base.replace(**overrides) if overrides else base


class KVPoolConnectorAdapter(ConnectorAdapter):
    """Creates :class:`KVPoolRemoteConnector` for ``plugin://kvpool`` (and ``kvpool://``)."""

    def __init__(self) -> None:
        super().__init__("kvpool://")

    def can_parse(self, url: str) -> bool:
        """True for ``kvpool://...`` and ``plugin://kvpool[.instance]``."""
        if url.startswith("plugin://"):
            return url[len("plugin://"):].split(".", 1)[0] == PLUGIN_TYPE
        return url.startswith(self.schema)

    def create_connector(self, context: ConnectorContext) -> KVPoolRemoteConnector:
        """Return a connector joined to the pool named by the context's config."""
        return KVPoolRemoteConnector(context.loop, context.local_cpu_backend, context.config,
                                     plugin_name=context.plugin_name or PLUGIN_TYPE)


class KVPoolRemoteConnector(RemoteConnector):
    """LMCache chunks stored as kvpool objects."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any,
                 plugin_name: str = PLUGIN_TYPE, client: Any = None) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        if getattr(config, "use_layerwise", False):
            raise ValueError("the kvpool LMCache connector stores whole chunks; "
                             "set use_layerwise: false")
        serde = getattr(config, "remote_serde", None)
        if serde not in (None, "naive"):
            # chunks are read back into KV-shaped memory objects of LMCache's layout: bytes of
            # another form (cachegen, kivi) would be taken for KV
            raise ValueError(f"the kvpool LMCache connector stores chunks as they are; set "
                             f"remote_serde: naive (not {serde!r})")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        if client is None:
            from kvpool_client.client import KVPoolClient

            client = KVPoolClient(client_config(getattr(config, "extra_config", None),
                                                plugin_name))
        self._client = client

    # --- helpers ---

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, call)

    async def _read_async(self, keys: list[Any]) -> list[Any]:
        """``_read`` off the loop. When the caller gives up waiting (LMCache times its reads
        out), the read still runs: the memory objects it then hands back are released."""
        future = asyncio.get_running_loop().run_in_executor(None, self._read, keys)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_release_read)
            raise

    def _allocate(self) -> Any:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)

    def _read(self, keys: list[Any]) -> list[Any]:
        memory_objs = [self._allocate() for _ in keys]
        wanted = [(k, m) for k, m in zip(keys, memory_objs, strict=True) if m is not None]
        if not wanted:
            return [None] * len(keys)
        try:
            read = self._client.batch_get_regions([_name(k) for k, _ in wanted],
                                                  [[_view(m)] for _, m in wanted])
        except KVPoolError as exc:
            logger.error("kvpool read of %d chunks failed: %s", len(wanted), exc)
            read = [int(exc.status)] * len(wanted)
        finished = iter([self._finish_read(m, int(nbytes))
                         for (_, m), nbytes in zip(wanted, read, strict=True)])
        # by position: a key twice in one batch has a memory object at each
        return [next(finished) if m is not None else None for m in memory_objs]

    def _finish_read(self, memory_obj: Any, nbytes: int) -> Any:
        if nbytes <= 0:
            if nbytes != Status.NOT_FOUND:
                logger.warning("kvpool read of a chunk failed with status %d", nbytes)
            memory_obj.ref_count_down()
            return None
        if nbytes == self.full_chunk_size_bytes:
            return memory_obj
        try:
            return self.reshape_partial_chunk(memory_obj, nbytes)
        except ValueError as exc:
            logger.error("kvpool chunk of %d bytes does not fit LMCache's layout: %s", nbytes,
                         exc)
            memory_obj.ref_count_down()
            return None

    def _write(self, keys: list[Any], memory_objs: list[Any]) -> None:
        statuses = self._client.batch_put_regions([_name(k) for k in keys],
                                                  [[_view(m)] for m in memory_objs])
        failed = [s for s in statuses if s not in (Status.OK, Status.ALREADY_EXISTS)]
        if failed:
            raise KVPoolError(Status(failed[0]),
                              f"{len(failed)} of {len(keys)} chunks were not stored")

    # --- RemoteConnector ---

    async def exists(self, key: Any) -> bool:
        """True when the chunk is in the pool."""
        return await self._run(lambda: self.exists_sync(key))

    def exists_sync(self, key: Any) -> bool:
        """True when the chunk is in the pool (False when the lookup fails)."""
        try:
            return bool(self._client.batch_exists([_name(key)])[0])
        except KVPoolError as exc:
            logger.error("kvpool exists failed: %s", exc)
            return False

    async def get(self, key: Any) -> Any:
        """The chunk as a memory object from LMCache's CPU backend, or None."""
        return (await self._read_async([key]))[0]

    async def put(self, key: Any, memory_obj: Any) -> None:
        """Store the chunk (an existing chunk is kept); raises ``KVPoolError`` on failure."""
        await self._run(lambda: self._write([key], [memory_obj]))

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[Any]) -> list[Any]:
        """Memory object or None per key, in one pool call."""
        return await self._read_async(list(keys))

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[Any], memory_objs: list[Any]) -> None:
        """Store every chunk in one pool call; raises ``KVPoolError`` when any failed."""
        await self._run(lambda: self._write(list(keys), list(memory_objs)))

    async def batched_async_contains(self, lookup_id: str, keys: list[Any],
                                     pin: bool = False) -> int:
        """Leading chunks in the pool, in one lookup (which leases them for the read)."""
        return await self._run(lambda: self.batched_contains(keys))

    def support_batched_async_contains(self) -> bool:
        return True

    def support_batched_contains(self) -> bool:
        return True

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[Any]) -> list[Any]:
        """The leading chunks that were read, in one pool call (LMCache's contract: the prefix
        up to the first missing chunk; chunks read after it are released at once)."""
        objs = await self._read_async(list(keys))
        prefix: list[Any] = []
        for obj in objs:
            if obj is None:
                break
            prefix.append(obj)
        for obj in objs[len(prefix):]:
            if obj is not None:
                obj.ref_count_down()
        return prefix

    def batched_contains(self, keys: list[Any]) -> int:
        """Leading chunks in the pool (0 when the lookup fails)."""
        if not keys:
            return 0
        try:
            return int(self._client.query_prefix([_name(k) for k in keys]))
        except KVPoolError as exc:
            logger.error("kvpool lookup of %d chunks failed: %s", len(keys), exc)
            return 0

    def remove_sync(self, key: Any) -> bool:
        """Remove the chunk; True when it was removed."""
        try:
            return self._client.batch_remove([_name(key)], force=True)[0] == Status.OK
        except KVPoolError as exc:
            logger.error("kvpool remove failed: %s", exc)
            return False

    async def list(self) -> list[str]:
        """Always empty: the kvpool master does not enumerate keys (neither does Mooncake's
        LMCache connector)."""
        return []

    async def close(self) -> None:
        """Leave the pool."""
        await self._run(self._client.close)


def _name(key: Any) -> str:
    return key.to_string() if not isinstance(key, str) else key


def _view(memory_obj: Any) -> memoryview:
    view = memory_obj.byte_array
    view = view if isinstance(view, memoryview) else memoryview(view)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _release_read(done: asyncio.Future[list[Any]]) -> None:
    """Release the memory objects of a read nobody waits for any more."""
    if done.cancelled() or done.exception() is not None:
        return
    for memory_obj in done.result():
        if memory_obj is not None:
            memory_obj.ref_count_down()

"""SGLang HiCache storage backend over kvpool (``--hicache-storage-backend dynamic``).

Rules of this file:
- SGLang loads it from ``--hicache-storage-backend-extra-config``::

    {"backend_name": "kvpool", "module_path": "kvpool_client.connectors.sglang",
     "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
     "kvpool": {"master_server_address": "10.0.0.1:50051", "global_segment_size": "4gb"}}

  builds it as ``cls(storage_config, kwargs)``, calls ``register_mem_pool_host(host_pool)`` and,
  with ``interface_v1``, moves pages with ``batch_set_v1`` / ``batch_get_v1`` straight between
  the host pool's memory and the pool, and looks up with ``batch_exists`` (leading hits).
- The client config is ``KVPOOL_CONFIG_PATH`` / ``MOONCAKE_CONFIG_PATH`` when set, with the
  ``"kvpool"`` sub-dict of the extra config applied on top (or alone when no file is named).
- One page is one object: the concatenation of the regions the host pool reports for that page
  (``get_page_buffer_meta``: K then V, per layer or per page depending on the layout).
- Keys are ``{model}@{rank tag}@{page hash}``: each tensor-parallel rank holds different heads,
  so its pages are its own; an MLA model's pages are the same on every rank, so they are shared
  and only the storage writer (rank 0 of the DCP group) writes them.
- The base class is SGLang's ``HiCacheStorage`` when SGLang is importable (its factory checks
  ``issubclass``); SGLang is not imported otherwise.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Sequence
from typing import Any

from kvpool_client.compat.memory import RegionRegistry, staged
from kvpool_client.config import ClientConfig, ConfigError
from kvpool_client.connectors._tensors import pointer_range
from kvpool_wire.status import KVPoolError, Status

logger = logging.getLogger(__name__)


def _storage_base() -> type:
    try:
        module = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    except ImportError:
        return object
    base: type = module.HiCacheStorage
    return base


def client_config(extra_config: dict[str, Any] | None) -> ClientConfig:
    """Return the client config for a storage backend's extra config (see the module doc)."""
    overrides = dict((extra_config or {}).get("kvpool") or {})
    try:
        base = ClientConfig.from_env()
    except ConfigError:
        if not overrides:
            raise
        return ClientConfig.from_dict(overrides, source="extra_config.kvpool")
    return base.replace(**overrides) if overrides else base


class KVPoolHiCacheStorage(_storage_base()):  # type: ignore[misc]
    """HiCache L3 storage whose pages live in a kvpool cluster."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        from kvpool_client.client import KVPoolClient

        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        extra = getattr(storage_config, "extra_config", None) or {}
        self._is_mla = bool(storage_config.is_mla_model)
        model = (storage_config.model_name or "model").replace("/", "-")
        rank = f"mla@pp{storage_config.pp_rank}" if self._is_mla else (
            f"tp{storage_config.tp_rank}of{storage_config.tp_size}@pp{storage_config.pp_rank}")
        self.key_prefix = f"{model}@{rank}@"
        self._writer = (not self._is_mla) or storage_config.tp_rank == \
            getattr(storage_config, "dcp_rank", 0)
        self._registry = RegionRegistry()
        self._client = KVPoolClient(client_config(extra))

    # --- host memory ---

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's host KV pool and register the memory its pages live in."""
        self.mem_pool_host = mem_pool_host
        for tensor in _pool_tensors(mem_pool_host):
            self._registry.register(*pointer_range(tensor))

    def _page_regions(self, keys: Sequence[str], host_indices: Any) -> list[list[tuple[int, int]]]:
        if len(host_indices) != len(keys) * self.mem_pool_host.page_size:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"{len(keys)} pages need {len(keys)} x page_size host indices, "
                              f"got {len(host_indices)}")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) != len(sizes) or len(ptrs) % len(keys):
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"{len(keys)} pages but {len(ptrs)} buffers from the host pool")
        per_page = len(ptrs) // len(keys)
        return [list(zip(ptrs[i:i + per_page], sizes[i:i + per_page], strict=True))
                for i in range(0, len(ptrs), per_page)]

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return [self.key_prefix + key for key in keys]

    # --- interface_v1 (zero copy) ---

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Return how many leading pages are in the pool (one lookup; leases the hits)."""
        if not keys:
            return 0
        try:
            return int(self._client.query_prefix(self._keys(keys)))
        except KVPoolError as exc:
            logger.error("kvpool lookup of %d pages failed: %s", len(keys), exc)
            return 0

    @staged
    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """Write each page from host memory; one bool per page (pages already there: True)."""
        if not self._writer:
            return [True] * len(keys)
        try:
            sources = [self._registry.sources(r)
                       for r in self._page_regions(keys, host_indices)]
            statuses = self._client.batch_put_regions(self._keys(keys), sources)
        except KVPoolError as exc:
            logger.error("kvpool write of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]

    @staged
    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """Read each page into host memory; True exactly when the whole page was filled."""
        try:
            dests = [self._registry.destination(r)
                     for r in self._page_regions(keys, host_indices)]
            read = self._client.batch_get_regions(self._keys(keys), [d.views for d in dests])
        except KVPoolError as exc:
            logger.error("kvpool read of %d pages failed: %s", len(keys), exc)
            return [False] * len(keys)
        return [n == sum(v.nbytes for v in d.views) for d, n in zip(dests, read, strict=True)]

    # --- the older per-value interface ---

    def exists(self, key: str) -> bool:
        """True when the page is in the pool."""
        try:
            return bool(self._client.batch_exists(self._keys([key]))[0])
        except KVPoolError as exc:
            logger.error("kvpool exists failed: %s", exc)
            return False

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        """Fill ``target_location`` (a tensor) with the page; it, or None when missing."""
        result = self.batch_get([key], [target_location])
        return result[0]

    @staged
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        """Fill each target tensor from its page; the tensor, or None when missing/short."""
        try:
            dests = [self._registry.destination([pointer_range(t)], registered_only=False)
                     for t in target_locations]
            read = self._client.batch_get_regions(self._keys(keys), [d.views for d in dests])
        except KVPoolError as exc:
            logger.error("kvpool read of %d pages failed: %s", len(keys), exc)
            return [None] * len(keys)
        results = []
        for tensor, dest, nbytes in zip(target_locations, dests, read, strict=True):
            complete = nbytes == dest.views[0].nbytes
            if complete:
                dest.finish(nbytes)
            results.append(tensor if complete else None)
        return results

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Write one page from a tensor; True on success (also when it was there)."""
        return self.batch_set([key], [value])

    @staged
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Write every page from tensors; True when all succeeded."""
        if not self._writer:
            return True
        try:
            sources = [self._registry.sources([pointer_range(v)], registered_only=False)
                       for v in values]
            statuses = self._client.batch_put_regions(self._keys(keys), sources)
        except KVPoolError as exc:
            logger.error("kvpool write of %d pages failed: %s", len(keys), exc)
            return False
        return all(s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses)

    def clear(self) -> None:
        """Remove this model's and rank's pages from the pool (other tenants' stay)."""
        try:
            self._client.remove_by_regex("^" + re.escape(self.key_prefix), force=True)
        except KVPoolError as exc:
            logger.error("kvpool clear failed: %s", exc)

    def close(self) -> None:
        """Leave the pool (idempotent)."""
        self._client.close()
        self._registry.clear()

    def get_stats(self) -> None:
        """No HiCache storage metrics (the kvpool client exports its own)."""
        return None


def _pool_tensors(pool: Any) -> list[Any]:
    tensors: list[Any] = []
    for name in ("kv_buffer", "k_buffer", "v_buffer"):
        value = getattr(pool, name, None)
        if value is None:
            continue
        tensors.extend(value if isinstance(value, list | tuple) else [value])
    if not tensors:
        raise KVPoolError(Status.INVALID_ARGUMENT, "the host pool exposes no KV buffer")
    return tensors


"""SGLang HiCache storage backend over kvpool (``--hicache-storage-backend dynamic``).

Rules of this file:
- SGLang loads it from ``--hicache-storage-backend-extra-config``::

    {"backend_name": "kvpool", "module_path": "kvpool_client.connectors.sglang",
     "class_name": "KVPoolHiCacheStorage", "interface_v1": 1,
     "kvpool": {"master_server_address": "10.0.0.1:50051", "global_segment_size": "4gb"}}

  builds it as ``cls(storage_config, kwargs)``, calls ``register_mem_pool_host(host_pool)`` and,
  with ``interface_v1``, moves pages with ``batch_set_v1`` / ``batch_get_v1`` straight between
  the host pool's memory and the pool, and looks up with ``batch_exists`` (leading hits).
- Hybrid models (Mamba, sliding window, DeepSeek V4, draft models) add pools with
  ``register_mem_host_pool_v2`` and move them with ``batch_exists_v2`` / ``batch_get_v2`` /
  ``batch_set_v2`` (``PoolTransfer``: a pool's page keys and host indices, and its hit policy);
  a read or write of all the pools of a batch is one pool call, a lookup two (the KV prefix,
  then every side pool's pages at once). An
  anchor host pool without a ``kv_buffer`` (DeepSeek V4) holds no bytes: its pages count as
  present and moved, the side pools carry the data.
- The client config is ``KVPOOL_CONFIG_PATH`` / ``MOONCAKE_CONFIG_PATH`` when set, with the
  ``"kvpool"`` sub-dict of the extra config applied on top (or alone when no file is named).
- One object is one page of one pool: the concatenation of the regions the host pool reports
  for that page (``get_page_buffer_meta``: K then V, per layer or per page depending on the
  layout); with ``should_split_heads``, one object per head slice of the page.
- Keys name the model, every rank that makes a page's bytes differ, and the pool
  (``sglang_pools``). MLA pages are the same on every TP rank, so they are shared and only the
  storage writer writes them.
- The base class is SGLang's ``HiCacheStorage`` when SGLang is importable (its factory checks
  ``issubclass``); SGLang is not imported otherwise. Checked against SGLang 0.5.23
  (``sglang/srt/mem_cache/hicache_storage.py``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from kvpool_client.compat.memory import RegionRegistry, staged
from kvpool_client.config import ClientConfig
from kvpool_client.connectors._tensors import pointer_range
from kvpool_client.connectors.sglang_pools import (
    KV_POOL,
    HitResult,
    KeyScheme,
    hits,
    objects_of_pages,
)
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
    return ClientConfig.from_env_with(dict((extra_config or {}).get("kvpool") or {}),
                                      source="extra_config.kvpool")


class KVPoolHiCacheStorage(_storage_base()):  # type: ignore[misc]
    """HiCache L3 storage whose pages live in a kvpool cluster."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        from kvpool_client.client import KVPoolClient

        self.storage_config = storage_config
        self.mem_pool_host: Any = None
        self.registered_pools: dict[Any, Any] = {}
        extra = getattr(storage_config, "extra_config", None) or {}
        try:
            self._scheme = KeyScheme.of(storage_config)
        except ValueError as exc:
            raise KVPoolError(Status.INVALID_ARGUMENT, str(exc)) from None
        self._split = len(self._scheme.kv_tags)
        writer = getattr(storage_config, "is_storage_writer", None)
        self._writer = bool(writer) if isinstance(writer, bool) else (
            not storage_config.is_mla_model
            or storage_config.tp_rank == getattr(storage_config, "dcp_rank", 0))
        self._registry = RegionRegistry()
        self._client = KVPoolClient(client_config(extra))

    # --- host memory ---

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Adopt SGLang's host KV pool (the anchor) and register the memory its pages live in;
        an anchor without a ``kv_buffer`` holds no bytes (see the module rules)."""
        self.mem_pool_host = mem_pool_host
        self._scheme = self._scheme.with_form(KV_POOL, *_form_of(mem_pool_host,
                                                                 self.storage_config))
        if self._logical_anchor():
            return
        tensors = _pool_tensors(mem_pool_host)
        if not tensors:
            raise KVPoolError(Status.INVALID_ARGUMENT, "the host pool exposes no KV buffer")
        for tensor in tensors:
            self._registry.register(*pointer_range(tensor))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Adopt one more host pool (a hybrid model's side pool) under its ``PoolName``."""
        self.registered_pools[host_pool_name] = host_pool
        if str(host_pool_name) == KV_POOL and host_pool is self.mem_pool_host:
            return
        self._scheme = self._scheme.with_form(str(host_pool_name),
                                              *_form_of(host_pool, self.storage_config))
        for tensor in _pool_tensors(host_pool):
            self._registry.register(*pointer_range(tensor))

    def on_host_pools_registered(self) -> None:
        """Nothing to finalise: pools are independent objects in kvpool."""

    def _logical_anchor(self) -> bool:
        pool = self.mem_pool_host
        return pool is not None and hasattr(pool, "kv_buffer") and pool.kv_buffer is None

    def _objects(self, pool: Any, name: str, page_keys: Sequence[str], host_indices: Any,
                 ) -> tuple[list[str], list[list[tuple[int, int]]]]:
        """The object keys of ``page_keys`` in pool ``name`` and, per object, the host
        regions it is made of."""
        page_size = getattr(pool, "page_size", 1) or 1
        if len(host_indices) != len(page_keys) * page_size:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"{len(page_keys)} pages need {len(page_keys)} x {page_size} "
                              f"host indices, got {len(host_indices)}")
        keys = self._scheme.keys(name, page_keys)
        if not keys:
            return [], []
        if name == KV_POOL and self._scheme.split_heads:
            ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices,
                                                                self._scheme.split_heads)
        else:
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        try:
            return keys, objects_of_pages(ptrs, sizes, len(keys))
        except ValueError as exc:
            raise KVPoolError(Status.INVALID_ARGUMENT, str(exc)) from None

    def _per_page(self, name: str, oks: Sequence[bool]) -> list[bool]:
        per = self._split if name == KV_POOL else 1
        return [all(oks[i:i + per]) for i in range(0, len(oks), per)]

    # --- interface_v1 (zero copy) ---

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Return how many leading pages are in the pool (one lookup; leases the hits)."""
        if not keys:
            return 0
        try:
            found = int(self._client.query_prefix(self._scheme.keys(KV_POOL, keys)))
        except KVPoolError as exc:
            logger.error("kvpool lookup of %d pages failed: %s", len(keys), exc)
            return 0
        return found // self._split

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """Write each page from host memory; one bool per page (pages already there: True)."""
        if not self._writer or self._logical_anchor():
            return [True] * len(keys)
        moved: list[list[bool]] = self._move([(KV_POOL, self.mem_pool_host, keys, host_indices)],
                                             writing=True)
        return moved[0]

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None
                     ) -> list[bool]:
        """Read each page into host memory; True exactly when the whole page was filled."""
        if self._logical_anchor():
            return [True] * len(keys)
        moved: list[list[bool]] = self._move([(KV_POOL, self.mem_pool_host, keys, host_indices)],
                                             writing=False)
        return moved[0]

    # --- interface v2 (hybrid models) ---

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        """The restorable prefix of ``keys`` (KV pages, then every pool's hit policy), as
        SGLang's ``PoolTransferResult``; one pool call for the side pools."""
        transfers = list(pool_transfers or [])
        kv_pages = len(keys) if self._logical_anchor() else self.batch_exists(keys)
        wanted = [self._scheme.keys(str(t.name), keys[:kv_pages]) for t in transfers]
        flat = [key for pool_keys in wanted for key in pool_keys]
        try:
            found = self._client.batch_exists(flat) if flat else []
        except KVPoolError as exc:
            logger.error("kvpool lookup of %d side-pool pages failed: %s", len(flat), exc)
            found = [False] * len(flat)
        at, present = 0, {}
        for transfer, pool_keys in zip(transfers, wanted, strict=True):
            present[id(transfer)] = found[at:at + len(pool_keys)]
            at += len(pool_keys)
        result = hits(kv_pages, transfers, lambda t, page: present[id(t)][page],
                      kv_name=_kv_pool_name())
        return _transfer_result(result)

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Read every transfer's pages into its host pool; per pool name, one bool per page."""
        return self._move_transfers(transfers, writing=False)

    def batch_set_v2(self, transfers: Any, extra_info: Any = None) -> dict[Any, list[bool]]:
        """Write every transfer's pages from its host pool; per pool name, one bool per page
        (pages already there: True)."""
        return self._move_transfers(transfers, writing=True)

    def _move_transfers(self, transfers: Any, *, writing: bool) -> dict[Any, list[bool]]:
        results: dict[Any, list[bool]] = {}
        jobs = []
        for transfer in transfers:
            name = str(transfer.name)
            keys = list(transfer.keys or [])
            pool = self.registered_pools.get(transfer.name)
            if pool is None and name == KV_POOL:
                pool = self.mem_pool_host
            if pool is None:
                logger.error("kvpool: pool %s was never registered", name)
                results[transfer.name] = [False] * len(keys)
            elif name == KV_POOL and (self._logical_anchor() or (writing and not self._writer)):
                results[transfer.name] = [True] * len(keys)
            else:
                jobs.append((transfer.name, pool, keys, transfer.host_indices))
        if jobs:
            outcomes = self._move([(str(n), p, k, i) for n, p, k, i in jobs], writing=writing)
            for (name, *_), outcome in zip(jobs, outcomes, strict=True):
                results[name] = outcome
        return results

    @staged
    def _move(self, jobs: Sequence[tuple[str, Any, Sequence[str], Any]], *, writing: bool,
              ) -> list[list[bool]]:
        """Move the pages of every (pool name, host pool, page keys, host indices) job in one
        pool call; per job, one bool per page (a job whose pages cannot be described fails
        alone)."""
        keys: list[str] = []
        regions: list[list[tuple[int, int]]] = []
        spans: list[tuple[int, int] | None] = []
        for name, pool, page_keys, host_indices in jobs:
            try:
                job_keys, job_regions = self._objects(pool, name, page_keys, host_indices)
            except (KVPoolError, AttributeError, TypeError) as exc:
                logger.error("kvpool: pages of pool %s cannot be moved: %s", name, exc)
                spans.append(None)
                continue
            spans.append((len(keys), len(keys) + len(job_keys)))
            keys += job_keys
            regions += job_regions
        oks: list[bool] = []
        try:
            if writing:
                sources = [self._registry.sources(r, registered_only=False) for r in regions]
                statuses = self._client.batch_put_regions(keys, sources) if keys else []
                oks = [s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses]
            else:
                dests = [self._registry.destination(r, registered_only=False) for r in regions]
                read = self._client.batch_get_regions(keys, [d.views for d in dests]) \
                    if keys else []
                for dest, nbytes in zip(dests, read, strict=True):
                    complete = nbytes == sum(v.nbytes for v in dest.views)
                    if complete:
                        dest.finish(nbytes)
                    oks.append(complete)
        except KVPoolError as exc:
            logger.error("kvpool %s of %d objects failed: %s", "write" if writing else "read",
                         len(keys), exc)
            oks = [False] * len(keys)
        outcomes = []
        for (name, _, page_keys, _), span in zip(jobs, spans, strict=True):
            outcomes.append([False] * len(page_keys) if span is None
                            else self._per_page(name, oks[span[0]:span[1]]))
        return outcomes

    # --- the older per-value interface ---

    def exists(self, key: str) -> bool:
        """True when the page is in the pool."""
        try:
            return bool(self._client.batch_exists(self._scheme.value_keys([key]))[0])
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
            read = self._client.batch_get_regions(self._scheme.value_keys(keys),
                                                  [d.views for d in dests])
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
            statuses = self._client.batch_put_regions(self._scheme.value_keys(keys), sources)
        except KVPoolError as exc:
            logger.error("kvpool write of %d pages failed: %s", len(keys), exc)
            return False
        return all(s in (Status.OK, Status.ALREADY_EXISTS) for s in statuses)

    def clear(self) -> None:
        """Remove this model's and rank's pages from the pool (other tenants' stay)."""
        try:
            self._client.remove_by_regex(self._scheme.clear_pattern(), force=True)
        except KVPoolError as exc:
            logger.error("kvpool clear failed: %s", exc)

    def close(self) -> None:
        """Leave the pool (idempotent)."""
        self._client.close()
        self._registry.clear()

    def get_stats(self) -> None:
        """No HiCache storage metrics (the kvpool client exports its own)."""
        return None


def _form_of(pool: Any, storage_config: Any) -> tuple[str, str]:
    """How a host pool lays a page's bytes out: its layout (or, where it names none, the
    storage config's ``is_page_first_layout``) and its dtype (with the device pool's where
    that differs: fp8 KV stored as bytes)."""
    layout = getattr(pool, "layout", None)
    if not isinstance(layout, str) or not layout:
        layout = ("page_first" if getattr(storage_config, "is_page_first_layout", False)
                  else "layer_first")
    names = [_dtype_name(getattr(pool, "dtype", None)),
             _dtype_name(getattr(getattr(pool, "device_pool", None), "dtype", None))]
    return layout, "-".join(dict.fromkeys(name for name in names if name))


def _dtype_name(dtype: Any) -> str:
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def _pool_tensors(pool: Any) -> list[Any]:
    """The tensors a host pool keeps its pages in: ``get_hybrid_pool_buffer()`` where the pool
    has it (SGLang's side pools), else its K/V buffers."""
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    found = list(getter()) if callable(getter) else [
        getattr(pool, name, None) for name in ("kv_buffer", "k_buffer", "v_buffer")]
    tensors: list[Any] = []
    for value in found:
        if value is not None:
            tensors.extend(value if isinstance(value, list | tuple) else [value])
    return tensors


def _kv_pool_name() -> Any:
    """SGLang's ``PoolName.KV`` (its results are keyed by the enum), or ``"kv"`` without
    SGLang."""
    try:
        module = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    except ImportError:
        return KV_POOL
    return module.PoolName.KV


def _transfer_result(result: HitResult) -> Any:
    """``result`` as SGLang's ``PoolTransferResult`` (the same fields without SGLang)."""
    try:
        module = importlib.import_module("sglang.srt.mem_cache.hicache_storage")
    except ImportError:
        return result
    return module.PoolTransferResult(result.kv_hit_pages, result.extra_pool_hit_pages,
                                     result.restorable_prefix_pages)

"""LMCache multiprocess mode: an L2 adapter whose objects live in a kvpool cluster.

Rules of this file:
- LMCache's multiprocess server (the one vLLM's ``LMCacheMPConnector`` talks to) loads it as a
  plugin L2 adapter::

    --l2-adapter '{"type": "plugin", "module_path": "kvpool_client.connectors.lmcache_mp",
                   "class_name": "KVPoolL2Adapter",
                   "adapter_params": {"master_server_address": "10.0.0.1:50051",
                                      "global_segment_size": "16gb"}}'

  ``adapter_params`` are kvpool client config keys laid over ``KVPOOL_CONFIG_PATH`` /
  ``MOONCAKE_CONFIG_PATH`` when one is set; ``key_prefix`` (default ``"lmcache@"``) and
  ``workers`` (threads running tasks, default 2) are the adapter's own.
- LMCache's store and prefetch controllers call it from their threads: every ``submit_*``
  returns a task id at once; the task runs on the adapter's worker threads as one pool call
  (``batch_put_regions``, ``batch_exists``, ``batch_get_regions``), zero copy from / into
  LMCache's L1 memory objects; its result is kept for ``pop_completed_store_tasks`` /
  ``query_*_result`` and its event fd is signalled.
- A key is ``{key_prefix}{model}@{kv rank:x}@{object group:x}@{chunk hash hex}[@{cache salt}]``
  (the fields of LMCache's ``ObjectKey``, as its file adapter names files).
- Lookup and lock: a hit is leased by the master for its lease time (the "lock": the object is
  not evicted or its bytes reused while leased); ``submit_unlock`` lets the lease run out.
  Eviction is the master's (watermarks over the whole pool), so the adapter declares no
  capacity of its own to LMCache.
- This module is imported only by LMCache, so it imports LMCache's base classes directly.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from kvpool_client.config import ClientConfig
from kvpool_wire.status import KVPoolError, Status

logger = logging.getLogger(__name__)

_ADAPTER_KEYS = ("key_prefix", "workers")


def client_config(params: dict[str, Any]) -> ClientConfig:
    """The kvpool client config of ``adapter_params`` (see the module rules)."""
    return ClientConfig.from_env_with(
        {k: v for k, v in params.items() if k not in _ADAPTER_KEYS}, source="l2 adapter_params")


def object_key_name(prefix: str, key: Any) -> str:
    """The pool key of an LMCache ``ObjectKey`` (see the module rules)."""
    name = (f"{prefix}{key.model_name}@{key.kv_rank:x}@{key.object_group_id:x}"
            f"@{key.chunk_hash.hex()}")
    return f"{name}@{key.cache_salt}" if key.cache_salt else name


class KVPoolL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """LMCache L2 adapter over a kvpool client (see the module docstring)."""

    def __init__(self, config: Any, l1_memory_desc: Any = None) -> None:
        super().__init__(max_capacity_bytes=0)
        params = dict(config if isinstance(config, dict) else vars(config))
        from kvpool_client.client import KVPoolClient

        self._prefix = str(params.get("key_prefix", "lmcache@"))
        workers = int(params.get("workers", 2))
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._client = KVPoolClient(client_config(params))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers,
                                                           thread_name_prefix="kvpool-l2")
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id = 0
        self._stored: dict[L2TaskId, L2StoreResult] = {}
        self._looked_up: dict[L2TaskId, Bitmap] = {}
        self._loaded: dict[L2TaskId, Bitmap] = {}
        self._name_to_size: dict[str, int] = {}  # objects this adapter stored (accounting)
        self._closed = False

    # -- event fds --------------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return int(self._store_fd.fileno())

    def get_lookup_and_lock_event_fd(self) -> int:
        return int(self._lookup_fd.fileno())

    def get_load_event_fd(self) -> int:
        return int(self._load_fd.fileno())

    # -- tasks ------------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        return self._submit(self._stored, self._store_fd, L2StoreResult(False, 0),
                            self._store, keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stored = self._stored, {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None
                                    ) -> L2TaskId:
        return self._submit(self._looked_up, self._lookup_fd, Bitmap(len(keys)),
                            self._lookup, keys)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Nothing to do: the leases the lookup took run out by themselves."""

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> L2TaskId:
        return self._submit(self._loaded, self._load_fd, Bitmap(len(keys)),
                            self._load, keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loaded.pop(task_id, None)

    def delete(self, keys: list[Any]) -> None:
        """Remove the objects (not forced: one a reader leases stays until its lease ends)."""
        names = [object_key_name(self._prefix, key) for key in keys]
        try:
            statuses = self._client.batch_remove(names)
        except KVPoolError as exc:
            logger.warning("kvpool: removing %d L2 objects failed: %s", len(keys), exc)
            return
        gone = [(key, name) for key, name, status in zip(keys, names, statuses, strict=True)
                if status == Status.OK]
        with self._lock:
            sizes = [self._name_to_size.pop(name, 0) for _, name in gone]
        if gone:
            self._notify_keys_deleted([key for key, _ in gone], sizes)

    def close(self) -> None:
        """Finish running tasks, leave the pool, close the event fds (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()
        for notifier in (self._store_fd, self._lookup_fd, self._load_fd):
            notifier.close()

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": not self._closed, "type": "KVPoolL2Adapter",
                "client_id": self._client.client_id}

    # -- the work, on the adapter's threads -------------------------------------------------------

    def _submit(self, done: dict[L2TaskId, Any], notifier: Any, failure: Any,
                work: Callable[..., Any], *args: Any) -> L2TaskId:
        """Run ``work(*args)`` on the adapter's threads; its result (``failure`` when it
        raised: a task must always complete, or LMCache waits for it forever) goes to ``done``
        under a new task id, and ``notifier`` is signalled."""
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
        self._pool.submit(self._run, done, notifier, failure, task_id, work, *args)
        return task_id

    def _run(self, done: dict[L2TaskId, Any], notifier: Any, failure: Any, task_id: L2TaskId,
             work: Callable[..., Any], *args: Any) -> None:
        try:
            result = work(*args)
        except KVPoolError as exc:
            logger.warning("kvpool L2 task %d failed: %s", task_id, exc)
            result = failure
        except Exception:
            logger.exception("kvpool L2 task %d failed", task_id)
            result = failure
        with self._lock:
            done[task_id] = result
        notifier.notify()

    def _store(self, keys: list[Any], objects: list[Any]) -> L2StoreResult:
        names = [object_key_name(self._prefix, key) for key in keys]
        statuses = self._client.batch_put_regions(names, [[obj.byte_array] for obj in objects])
        stored: list[tuple[Any, str, int]] = []
        seen: set[str] = set()   # a key twice in one batch is stored, and told, once
        for key, name, obj, status in zip(keys, names, objects, statuses, strict=True):
            if status == Status.OK and name not in seen:
                seen.add(name)
                stored.append((key, name, obj.get_size()))
        with self._lock:
            self._name_to_size.update((name, size) for _, name, size in stored)
        if stored:
            self._notify_keys_stored([key for key, _, _ in stored],
                                     [size for _, _, size in stored])
        return L2StoreResult(all(status in (Status.OK, Status.ALREADY_EXISTS)
                                 for status in statuses),
                             sum(size for _, _, size in stored))

    def _lookup(self, keys: list[Any]) -> Bitmap:
        found = self._client.batch_exists([object_key_name(self._prefix, k) for k in keys])
        bitmap = Bitmap(len(keys))
        for index, hit in enumerate(found):
            if hit:
                bitmap.set(index)
        return bitmap

    def _load(self, keys: list[Any], objects: list[Any]) -> Bitmap:
        names = [object_key_name(self._prefix, key) for key in keys]
        read = self._client.batch_get_regions(names, [[obj.byte_array] for obj in objects])
        bitmap = Bitmap(len(keys))
        loaded = []
        for index, (key, obj, nbytes) in enumerate(zip(keys, objects, read, strict=True)):
            if nbytes == obj.get_size():
                bitmap.set(index)
                loaded.append(key)
        if loaded:
            self._notify_keys_accessed(loaded)
        return bitmap

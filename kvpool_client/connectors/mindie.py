"""MindIE's ``MemPool`` over kvpool's native client.

Rules of this file:
- The shape is MindIE's (``mindie_llm/text_generator/mempool``): ``KVPoolMempool(config_path,
  role, **kwargs)`` with ``exists``, ``batch_exist``, ``put(keys, tensors)``,
  ``get(keys, tensors)`` and ``close``. MindIE's own base class is used when ``mindie_llm`` is
  importable; nothing here imports MindIE, torch or torch_npu otherwise.
- Role ``scheduler`` contributes no memory (segment and buffer size 0) and only looks keys up;
  role ``worker`` registers every layer's K and V cache tensor (``kv_caches``: per layer
  ``(k_blocks, v_blocks)``) and moves blocks. A key's object is the concatenation of the tensors
  given for it, in order: MindIE passes ``[k_cache[l][block], v_cache[l][block]] for l``.
- ``config_path`` is the same JSON MindIE hands its Mooncake pool (a kvpool client config is a
  superset of Mooncake's); ``master_server_address`` names the kvpool master.
- Every method may be called from any thread (MindIE's asyncWrite puts from a background
  thread); results are per key, and a failure never raises out of ``put``/``get``.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

from kvpool_client.compat.memory import RegionRegistry, staged
from kvpool_client.config import ClientConfig
from kvpool_client.connectors._tensors import pointer_range, pointer_ranges
from kvpool_wire.status import KVPoolError, Status

logger = logging.getLogger(__name__)

ROLES = ("scheduler", "worker")


def _mempool_base() -> type:
    try:
        module = importlib.import_module("mindie_llm.text_generator.mempool.base")
    except ImportError:
        return object
    base: type = module.MemPool
    return base


class KVPoolMempool(_mempool_base()):  # type: ignore[misc]
    """A MindIE memory pool whose objects live in a kvpool cluster."""

    def __init__(self, config_path: str, role: str, **kwargs: Any) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        config = ClientConfig.from_file(config_path)
        if role == "scheduler":
            config = config.replace(global_segment_size=0, local_buffer_size=0)
        from kvpool_client.client import KVPoolClient

        self.role = role
        self.device_id = int(kwargs.get("device_id", 0))
        self._registry = RegionRegistry()
        self._client = KVPoolClient(config)
        if role == "worker":
            kv_caches = kwargs.get("kv_caches")
            if kv_caches is None:
                self._client.close()
                raise ValueError("a worker pool needs kv_caches (per layer (k_cache, v_cache))")
            try:
                self._register(kv_caches)
            except KVPoolError:
                self._client.close()
                raise
        logger.info("kvpool MindIE %s pool ready (host %s)", role, self._client.hostname)

    def _register(self, kv_caches: Sequence[Sequence[Any]]) -> None:
        for layer in kv_caches:
            for cache in (layer[0], layer[1]):
                self._registry.register(*pointer_range(cache))

    def exists(self, key: str, **kwargs: Any) -> bool:
        """True when ``key`` is in the pool (False on any failure)."""
        return self.batch_exist([key])[0]

    def batch_exist(self, keys: list[str]) -> list[bool]:
        """One bool per key (all False when the lookup fails)."""
        try:
            return [bool(found) for found in self._client.batch_exists(list(keys))]
        except KVPoolError as exc:
            logger.error("kvpool batch_exist of %d keys failed: %s", len(keys), exc)
            return [False] * len(keys)

    def count_leading_hits(self, block_rank_keys: Sequence[Sequence[str]]) -> int:
        """Return how many leading blocks have every rank's key in the pool (one RPC).

        ``block_rank_keys[b]`` holds block ``b``'s key for each TP rank; the scheduler asks from
        the first block after the on-chip hits. Read leases are granted on the hits.
        """
        flat = [key for block in block_rank_keys for key in block]
        if not flat:
            return 0
        try:
            hits = int(self._client.query_prefix(flat))
        except KVPoolError as exc:
            logger.error("kvpool lookup of %d keys failed: %s", len(flat), exc)
            return 0
        count = 0
        for block in block_rank_keys:
            hits -= len(block)
            if hits < 0:
                break
            count += 1
        return count

    @staged
    def put(self, keys: str | list[str], tensors: Any, **kwargs: Any) -> list[bool]:
        """Store each key's tensors as one object; one bool per key (existing keys: True)."""
        pairs = _pairs(keys, tensors)
        if pairs is None:
            return [False]
        names, regions = [], []
        results = [False] * len(pairs)
        positions = []
        for i, (key, key_tensors) in enumerate(pairs):
            try:
                regions.append(self._registry.sources(pointer_ranges(key_tensors)))
            except KVPoolError as exc:
                logger.error("kvpool put of %s: %s", key, exc)
                continue
            names.append(key)
            positions.append(i)
        if names:
            try:
                statuses = self._client.batch_put_regions(names, regions)
            except KVPoolError as exc:
                logger.error("kvpool put of %d keys failed: %s", len(names), exc)
                return results
            for i, status in zip(positions, statuses, strict=True):
                results[i] = status in (Status.OK, Status.ALREADY_EXISTS)
        return results

    @staged
    def get(self, keys: str | list[str], tensors: Any, **kwargs: Any) -> list[bool]:
        """Fill each key's tensors from its object; True exactly when all of them were filled."""
        pairs = _pairs(keys, tensors)
        if pairs is None:
            return [False]
        names, dests, positions = [], [], []
        results = [False] * len(pairs)
        for i, (key, key_tensors) in enumerate(pairs):
            try:
                dests.append(self._registry.destination(pointer_ranges(key_tensors)))
            except KVPoolError as exc:
                logger.error("kvpool get of %s: %s", key, exc)
                continue
            names.append(key)
            positions.append(i)
        if not names:
            return results
        try:
            read = self._client.batch_get_regions(names, [d.views for d in dests])
        except KVPoolError as exc:
            logger.error("kvpool get of %d keys failed: %s", len(names), exc)
            return results
        for i, dest, nbytes in zip(positions, dests, read, strict=True):
            expected = sum(v.nbytes for v in dest.views)
            if nbytes != expected:
                logger.warning("kvpool get of %s: %d of %d bytes", pairs[i][0], nbytes, expected)
                continue
            try:
                dest.finish(nbytes)
            except KVPoolError as exc:
                logger.error("kvpool get of %s: %s", pairs[i][0], exc)
                continue
            results[i] = True
        return results

    def close(self) -> None:
        """Leave the pool (idempotent)."""
        self._client.close()
        self._registry.clear()


def _pairs(keys: str | list[str], tensors: Any) -> list[tuple[str, Any]] | None:
    if isinstance(keys, str):
        return [(keys, [tensors])]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        logger.error("keys must be a str or a list of str, got %s", type(keys).__name__)
        return None
    if not isinstance(tensors, list) or len(tensors) != len(keys):
        logger.error("tensors must be a list with one entry per key (%d keys)", len(keys))
        return None
    return list(zip(keys, tensors, strict=True))

"""The rest of Mooncake 0.3.13's store surface: upserts, parts, buffer handles, range reads, and
the calls kvpool cannot serve (the tensor calls are in ``tensor_calls``).

Rules of this file:
- ``upsert*`` replace an object: the old one is force-removed, then the new one put. A reader
  sees the old bytes, NOT_FOUND, or the new bytes, never a mix (a forced remove keeps the old
  bytes until every reader of them is done). Unlike Mooncake's in-place upsert, the window
  between the two steps is visible as NOT_FOUND.
- ``get_buffer`` / ``batch_get_buffer`` return a :class:`BufferHandle` (the object's bytes in
  host memory this process owns) or None when the key is missing.
- ``get_into_ranges`` copies byte ranges of objects into registered buffers; per buffer, per
  key, per range the bytes copied or a negative code.
- Both read through ``batch_get_with``: each byte is copied once, from the segment (or the
  buffer a remote read filled) to its destination.
- ``batch_replica_clear`` removes objects no lease protects and returns their keys. kvpool keeps
  an object's replicas together, so clearing the replica on this client's own segment clears
  the object; a segment name that is not this client's clears nothing.
- Calls of features kvpool does not have (tensors placed by a parallelism layout, CUDA
  destinations, safetensors files, NoF/DFS tiers, SSD segments, copy and move tasks, dummy
  clients) exist and answer -1012 (``NOT_SUPPORTED``), Mooncake's own code for
  "not supported in the current mode", never ``AttributeError``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvpool_client.compat import codes
from kvpool_client.compat.replicate import ReplicateConfig, put_options
from kvpool_client.compat.store_types import ReplicaDescriptor
from kvpool_wire.status import KVPoolError

logger = logging.getLogger(__name__)

NOT_SUPPORTED = -1012

#: Mooncake 0.3.13 calls that need a feature kvpool does not have.
UNSUPPORTED_CALLS = (
    "alloc_from_mem_pool", "allocate_and_mount_segment", "append",
    "batch_get_tensor_into_cuda", "batch_get_tensor_with_parallelism",
    "batch_get_tensor_with_parallelism_into", "batch_put_tensor_with_parallelism",
    "batch_put_tensor_with_parallelism_from", "batch_upsert_tensor_with_parallelism",
    "batch_upsert_tensor_with_parallelism_from", "create_copy_task", "create_move_task",
    "get_offload_rpc_read_count", "get_tensor_into_cuda",
    "get_tensor_with_parallelism", "get_tensor_with_parallelism_into", "init_all",
    "load_tensor_from_safetensor", "mount_segment", "put_from_with_metadata",
    "put_tensor_with_parallelism", "put_tensor_with_parallelism_from", "query_task",
    "save_tensor_to_safetensor", "setup_dummy", "unmount_and_free_segment",
    "unmount_local_disk_segment", "unmount_segment", "upsert_tensor_with_parallelism",
    "upsert_tensor_with_parallelism_from",
)


class BufferHandle(bytearray):
    """An object's bytes in memory this process owns (Mooncake's ``BufferHandle``)."""

    def ptr(self) -> int:
        """The address of the first byte."""
        if not self:
            return 0
        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self))

    def size(self) -> int:
        """The object's size in bytes."""
        return len(self)


def _unsupported(name: str) -> Callable[..., int]:
    def call(self: Any, *args: Any, **kwargs: Any) -> int:
        logger.error("%s: not supported by kvpool", name)
        return NOT_SUPPORTED
    call.__name__ = name
    call.__doc__ = f"Mooncake's ``{name}``: a feature kvpool does not have; answers -1012."
    return call


class StoreExtras:
    """Mixed into ``MooncakeDistributedStore`` (which provides ``put``, ``put_batch``,
    ``batch_put_from``, ``batch_remove``, ``get_batch``, ``_one``, ``_registry`` and
    ``_own_segment``)."""

    # --- upserts and parts ---

    def upsert(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` under ``key``, replacing an existing object; 0 or a code."""
        return self.upsert_batch([key], [value], config)

    def upsert_batch(self, keys: Sequence[str], values: Sequence[Any],
                     config: ReplicateConfig | None = None) -> int:
        """Replace every object; 0 when all succeeded, else the first failing code."""
        refused = self._replacing(keys, config)
        return refused if refused is not None else \
            self.put_batch(keys, values, config)  # type: ignore[attr-defined]

    def upsert_from(self, key: str, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        """Replace ``key`` with ``size`` bytes at ``buffer_ptr``; 0 or a code."""
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int],
                          config: ReplicateConfig | None = None) -> list[int]:
        """0 / negative code per key."""
        refused = self._replacing(keys, config)
        if refused is not None:
            return [refused] * len(keys)
        return list(self.batch_put_from(  # type: ignore[attr-defined]
            keys, buffer_ptrs, sizes, config))

    def put_parts(self, key: str, *parts: Any, config: ReplicateConfig | None = None) -> int:
        """Store the concatenation of ``parts`` (bytes-like) under ``key``; 0 or a code."""
        return self._write_objects("put_parts", [key], [[memoryview(p) for p in parts]], config,
                                   replace=False)[0]

    def upsert_parts(self, key: str, *parts: Any,
                     config: ReplicateConfig | None = None) -> int:
        """Replace ``key`` with the concatenation of ``parts``; 0 or a code."""
        return self._write_objects("upsert_parts", [key], [[memoryview(p) for p in parts]],
                                   config, replace=True)[0]

    def _write_objects(self, op: str, keys: Sequence[str],
                       objects: Sequence[list[memoryview] | int],
                       config: ReplicateConfig | None, *, replace: bool) -> list[int]:
        """Write each object from its regions, in order, in one batch (replacing what is there
        with ``replace``); an ``int`` in ``objects`` is a code refusing that key, kept as it is.
        An object larger than ``local_buffer_size`` is -600, as Mooncake. 0 / code per key."""
        results = [obj if isinstance(obj, int) else codes.OK for obj in objects]
        wanted: list[int] = []
        for i, obj in enumerate(objects):
            if isinstance(obj, int):
                continue
            if self._fits_local_buffer([sum(v.nbytes for v in obj)]):  # type: ignore[attr-defined]
                wanted.append(i)
            else:
                results[i] = codes.INVALID_PARAMS
        if not wanted:
            return results
        wanted_keys = [keys[i] for i in wanted]
        try:
            options = put_options(config, self._own_segment)  # type: ignore[attr-defined]
        except KVPoolError as exc:
            logger.error("%s: %s", op, exc)
            for i in wanted:
                results[i] = codes.code_of_error(exc)
            return results
        refused = self._replacing(wanted_keys, config) if replace else None
        regions = [objects[i] for i in wanted]
        written = [refused] * len(wanted) if refused is not None else \
            self._batch(len(wanted), op, lambda c: codes.per_key_codes(  # type: ignore[attr-defined]
                c.batch_put_regions(wanted_keys, regions, options=options)))
        for i, code in zip(wanted, written, strict=True):
            results[i] = code
        return results

    def _replacing(self, keys: Sequence[str], config: ReplicateConfig | None) -> int | None:
        """Check ``config`` and force-remove ``keys``; a code when the upsert must not go on."""
        try:
            put_options(config, self._own_segment)  # type: ignore[attr-defined]
        except KVPoolError as exc:
            return codes.code_of_error(exc)
        removed = self.batch_remove(keys, True)  # type: ignore[attr-defined]
        failed = [code for code in removed if code not in (codes.OK, codes.NOT_FOUND)]
        return failed[0] if failed else None

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Remove the objects of ``keys`` that no lease protects (on ``segment_name``: this
        client's own segment, or any when empty); returns the keys removed."""
        if not keys:
            return []
        if segment_name and segment_name not in self._own_names():
            return []
        removed = self.batch_remove(keys, False)  # type: ignore[attr-defined]
        return [key for key, code in zip(keys, removed, strict=True) if code == codes.OK]

    def _own_names(self) -> set[str]:
        client = self._client  # type: ignore[attr-defined]
        if client is None:
            return set()
        return {self._segment_name, client.hostname,  # type: ignore[attr-defined]
                *client.segment_ids} - {""}

    # --- where objects lie ---

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The replicas of ``key`` (empty when it is missing)."""
        return self.batch_get_replica_desc([key]).get(key, [])

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """The replicas of each key that exists (missing keys are left out, as Mooncake does).
        Nothing is read; the lookup's read lease is given back with the next call."""
        found = self._one("batch_get_replica_desc",  # type: ignore[attr-defined]
                          lambda c: c.batch_replicas(list(keys)))
        if isinstance(found, int):
            return {}
        out: dict[str, list[ReplicaDescriptor]] = {}
        for key, where in zip(keys, found, strict=True):
            if where is not None:
                out[key] = [ReplicaDescriptor.in_memory(p.offset, p.length,
                                                        info.tcp_endpoint if info else "")
                            for p, info in where[1]]
        return out

    # --- reads into memory this process owns ---

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes in a :class:`BufferHandle`, or None when it is missing."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str]) -> list[BufferHandle | None]:
        """A :class:`BufferHandle` per key, None for each missing one (the object's bytes are
        copied once, from where they lie into the handle)."""
        handles: list[BufferHandle | None] = [None] * len(keys)
        if not keys:
            return handles

        def consume(index: int, view: memoryview) -> None:
            handles[index] = BufferHandle(view)

        read = self._one("batch_get_buffer",  # type: ignore[attr-defined]
                         lambda c: c.batch_get_with(list(keys), consume))
        failed = range(len(keys)) if isinstance(read, int) else \
            [i for i, n in enumerate(read) if n < 0]
        for index in failed:
            handles[index] = None  # a read that failed after consuming must not be kept
        return handles

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[str]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]) -> list[list[list[int]]]:
        """Copy ``all_sizes[b][k][r]`` bytes at ``all_src_offsets[b][k][r]`` of object
        ``all_keys[b][k]`` to ``buffer_ptrs[b] + all_dst_offsets[b][k][r]`` (a registered
        buffer), straight from where the object lies. Per buffer, per key, per range: the
        bytes copied or a negative code (-600 for ranges of unequal lengths or outside the
        object or buffer, -704 for a missing key)."""
        if not (len(buffer_ptrs) == len(all_keys) == len(all_dst_offsets)
                == len(all_src_offsets) == len(all_sizes)):
            return [[[codes.INVALID_PARAMS]] for _ in buffer_ptrs]
        results: list[list[list[int]]] = []
        # per key: (its result list, range index, destination address, source offset, size)
        jobs: dict[str, list[tuple[list[int], int, int, int, int]]] = {}
        for b, ptr in enumerate(buffer_ptrs):
            if not (len(all_keys[b]) == len(all_dst_offsets[b]) == len(all_src_offsets[b])
                    == len(all_sizes[b])):
                results.append([[codes.INVALID_PARAMS] for _ in all_keys[b]])
                continue
            per_key: list[list[int]] = []
            for k, key in enumerate(all_keys[b]):
                dsts, srcs, sizes = all_dst_offsets[b][k], all_src_offsets[b][k], all_sizes[b][k]
                if not len(dsts) == len(srcs) == len(sizes):
                    per_key.append([codes.INVALID_PARAMS])
                    continue
                out = [codes.NOT_FOUND] * len(sizes)
                per_key.append(out)
                for r, (dst, src, size) in enumerate(zip(dsts, srcs, sizes, strict=True)):
                    jobs.setdefault(key, []).append((out, r, ptr + dst, src, size))
            results.append(per_key)
        if not jobs:
            return results
        wanted = list(jobs)

        def consume(index: int, view: memoryview) -> None:
            for out, r, address, src, size in jobs[wanted[index]]:
                out[r] = self._range_to(address, view, src, size)

        read = self._one("get_into_ranges",  # type: ignore[attr-defined]
                         lambda c: c.batch_get_with(wanted, consume))
        for key, nbytes in zip(wanted, [read] * len(wanted) if isinstance(read, int) else read,
                               strict=True):
            if nbytes < 0:
                for out, r, *_ in jobs[key]:
                    out[r] = codes.mooncake_code(nbytes)
        return results

    def _range_to(self, address: int, view: memoryview, src: int, size: int) -> int:
        """Copy ``view[src:src+size]`` to registered memory at ``address``; size or a code."""
        if min(src, size) < 0 or src + size > view.nbytes:
            return codes.INVALID_PARAMS
        try:
            self._registry.write_at(address, view[src:src + size])  # type: ignore[attr-defined]
        except KVPoolError as exc:
            return codes.code_of_error(exc)
        return size

for _name in UNSUPPORTED_CALLS:
    setattr(StoreExtras, _name, _unsupported(_name))

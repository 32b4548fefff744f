"""``MooncakeDistributedStore`` over kvpool: Mooncake Store's Python surface and return codes.

Rules of this file:
- Every call engines make (MindIE, vLLM, vllm-ascend, SGLang, LMCache) is here, with
  Mooncake's argument forms and integer results: 0 / negative code per key, bytes read per
  key, ``b""`` for a missing ``get``, 1/0/<0 for existence. Nothing raises for an expected
  failure; the reason is logged and the code returned, as Mooncake's binding does.
- A put of an existing key returns 0 and keeps the first value (kvpool's put is write-once).
- Raw pointers must lie inside a registered region (``register_buffer`` here or
  ``register_memory`` on the TransferEngine whose handle was given to ``setup``); anything else
  is -600 before a byte moves. Device regions are staged through host memory (``memory.py``).
  One exception: Ascend's fabric-memory mode (``ASCEND_ENABLE_USE_FABRIC_MEM=1``, protocol
  ``ascend``, no engine), where engines register nothing; each pointer is then checked against
  this process's memory map and the device runtime instead, as MindIE's non-direct calls are.
- An object written from several regions is their concatenation, in order; a multi-buffer get
  succeeds exactly when it fills every region (``ret == sum(sizes)``), otherwise, as Mooncake
  0.3.13 answers: -600 when the object is larger than the regions, -800 when smaller.
- No state is tied to the thread or event loop that called ``setup``: the kvpool client runs
  its own loop thread and every method may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool_client.compat import codes
from kvpool_client.compat.engine import EngineHandle, TransferEngine
from kvpool_client.compat.extras import BufferHandle, StoreExtras
from kvpool_client.compat.memory import Destination, RegionRegistry, staged
from kvpool_client.compat.replicate import ReplicateConfig, SoftPinAction, put_options
from kvpool_client.compat.sessions import StoreSessions
from kvpool_client.compat.setup_args import parse_setup
from kvpool_client.compat.tensor_calls import StoreTensors
from kvpool_wire.status import KVPoolError, Status

__all__ = ["BufferHandle", "MooncakeDistributedStore", "ReplicateConfig", "SoftPinAction",
           "TransferEngine"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


class MooncakeDistributedStore(StoreSessions, StoreTensors, StoreExtras):
    """Mooncake Store's client API, backed by a :class:`kvpool_client.KVPoolClient` (the
    calls engines make here; the session calls in ``sessions``, the tensor calls in
    ``tensor_calls``, the rest of Mooncake 0.3.13's surface in ``extras``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._client: Any = None
        self._registry = RegionRegistry()
        self._segment_name = ""
        self._unregistered_ok = False  # Ascend fabric-memory mode: pointers are not registered
        self._open_sessions()

    # --- lifecycle ---

    def setup(self, *args: Any, **kwargs: Any) -> int:
        """Join the pool; 0, or a negative code (the reason is logged).

        Takes Mooncake's positional/keyword arguments or one config dict (see setup_args.py).
        """
        from kvpool_client.client import KVPoolClient

        try:
            setup = parse_setup(args, kwargs)
            engine = _real_engine(setup.engine)
            with self._lock:
                if self._client is not None:
                    raise KVPoolError(Status.INVALID_ARGUMENT, "setup was already called")
                client = KVPoolClient(setup.config, engine=engine)
                self._client = client
                self._segment_name = setup.segment_name
                if isinstance(setup.engine, EngineHandle):
                    self._registry = setup.engine.registry
                # A real engine's caller registers its memory there, out of this store's
                # sight: pointers are checked against the process's memory instead.
                self._unregistered_ok = _fabric_memory_mode(setup.config.protocol,
                                                            setup.engine) or \
                    (setup.engine is not None and not isinstance(setup.engine, EngineHandle))
        except KVPoolError as exc:
            logger.error("MooncakeDistributedStore.setup failed: %s", exc)
            return codes.code_of_error(exc)
        return codes.OK

    def close(self) -> int:
        """Leave the pool (idempotent); 0."""
        with self._lock:
            client, self._client = self._client, None
        self._drop_sessions()
        if client is not None:
            try:
                client.close()
            except KVPoolError as exc:
                logger.warning("MooncakeDistributedStore.close: %s", exc)
        return codes.OK

    def get_hostname(self) -> str:
        """Return ``"ip:port"`` of this client's data server (``""`` before setup)."""
        client = self._client
        return str(client.hostname) if client is not None else ""

    def health_check(self) -> int:
        """As Mooncake's: 0 healthy, 1 not set up (or closed), 2 the master does not answer
        (this client's last heartbeat went unanswered, or its liveness lapsed)."""
        client = self._client
        if client is None:
            return codes.HEALTH_NOT_SET_UP
        return codes.OK if client.master_answers else codes.HEALTH_MASTER_UNREACHABLE

    # --- memory ---

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Register ``[buffer_ptr, buffer_ptr+size)`` (host, CUDA or NPU memory); 0 or -600.
        With a transfer engine, the engine registers it too: its bytes then move in place."""
        try:
            self._registry.register(buffer_ptr, size)
            client = self._client
            if client is not None and client.has_engine:
                client.register_memory(buffer_ptr, size)
        except KVPoolError as exc:
            logger.error("register_buffer: %s", exc.message)
            return codes.code_of_error(exc)
        return codes.OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forget the buffer registered at ``buffer_ptr``; 0, or -600 when there is none."""
        try:
            self._registry.unregister(buffer_ptr)
            client = self._client
            if client is not None and client.has_engine:
                client.unregister_memory(buffer_ptr)
        except KVPoolError as exc:
            logger.error("unregister_buffer: %s", exc.message)
            return codes.code_of_error(exc)
        return codes.OK

    # --- existence and size ---

    def is_exist(self, key: str) -> int:
        """1 when ``key`` is readable, 0 when not, a negative code on failure."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """1 / 0 / negative code per key."""
        return self._batch(len(keys), "batch_is_exist",
                           lambda c: [1 if found else 0 for found in c.batch_exists(list(keys))])

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or -704 when it does not exist."""
        size = self._one("get_size", lambda c: c.get_size(key))
        if size is None:
            return codes.NOT_FOUND
        return int(size)

    # --- bytes API ---

    def put(self, key: str, value: Any, config: ReplicateConfig | None = None) -> int:
        """Store ``value`` (bytes-like) under ``key``; 0 (also when it exists) or a code
        (-600 for a value larger than ``local_buffer_size``, as Mooncake, which stages it
        there)."""
        if not self._fits_local_buffer([_nbytes(value)]):
            return codes.INVALID_PARAMS
        return self._one("put", lambda c: _ok(
            c.put(key, value, options=put_options(config, self._own_segment))))

    def put_batch(self, keys: Sequence[str], values: Sequence[Any],
                  config: ReplicateConfig | None = None) -> int:
        """Store every value; 0 when all succeeded, else the first failing code. A batch with
        an empty value stores nothing (-600), as Mooncake's."""
        sizes = [_nbytes(v) for v in values]
        if len(keys) != len(values) or 0 in sizes or not self._fits_local_buffer(sizes):
            return codes.INVALID_PARAMS
        results = self._batch(len(keys), "put_batch", lambda c: codes.per_key_codes(
            c.put_batch(list(keys), list(values),
                        options=put_options(config, self._own_segment))))
        return next((r for r in results if r != codes.OK), codes.OK)

    def get(self, key: str) -> bytes:
        """The object's bytes, or ``b""`` when it is missing (or the read failed)."""
        data = self._one("get", lambda c: c.get(key))
        return data if isinstance(data, bytes) else b""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """Bytes per key, ``b""`` for each missing one."""
        client = self._client
        if client is None:
            return [b""] * len(keys)
        try:
            return [d if d is not None else b"" for d in client.get_batch(list(keys))]
        except KVPoolError as exc:
            logger.error("get_batch: %s", exc)
            return [b""] * len(keys)

    # --- zero-copy API over registered memory ---

    def put_from(self, key: str, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Store ``size`` bytes at ``buffer_ptr``; 0 or a negative code."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None) -> list[int]:
        """0 / negative code per key; each object is ``sizes[i]`` bytes at ``buffer_ptrs[i]``."""
        if not _same_lengths(keys, buffer_ptrs, sizes):
            return [codes.INVALID_PARAMS] * len(keys)
        return self._put_ranges("batch_put_from", keys,
                                [[(p, s)] for p, s in zip(buffer_ptrs, sizes, strict=True)],
                                config)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Bytes read into ``buffer_ptr``; -704 when missing, -600 when ``size`` is too small."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Bytes read per key, or a negative code."""
        if not _same_lengths(keys, buffer_ptrs, sizes):
            return [codes.INVALID_PARAMS] * len(keys)
        return self._get_ranges("batch_get_into", keys,
                                [[(p, s)] for p, s in zip(buffer_ptrs, sizes, strict=True)],
                                exact=False)

    def batch_put_from_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """0 / negative code per key; each object is the concatenation of its regions."""
        ranges = _multi_ranges(keys, all_buffer_ptrs, all_sizes)
        if ranges is None:
            return [codes.INVALID_PARAMS] * len(keys)
        return self._put_ranges("batch_put_from_multi_buffers", keys, ranges, config)

    def batch_get_into_multi_buffers(self, keys: Sequence[str],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Total bytes read per key (success is exactly ``sum(sizes[i])``), or a negative code.

        ``prefer_alloc_in_same_node`` is accepted for Mooncake's signature; kvpool reads the
        nearest replica anyway.
        """
        ranges = _multi_ranges(keys, all_buffer_ptrs, all_sizes)
        if ranges is None:
            return [codes.INVALID_PARAMS] * len(keys)
        return self._get_ranges("batch_get_into_multi_buffers", keys, ranges, exact=True)

    def batch_put_from_ascend(self, key: str, addrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        """MindIE's non-direct Ascend put of one key's regions: ``[code]``.

        Its pointers are never registered, so ranges outside every registered region are
        checked against this process's memory (or a device runtime) instead of refused.
        """
        ranges = _multi_ranges([key], [addrs], [sizes])
        if ranges is None:
            return [codes.INVALID_PARAMS]
        return self._put_ranges("batch_put_from_ascend", [key], ranges, None,
                                registered_only=False)

    def batch_get_into_ascend(self, key: str, addrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        """MindIE's non-direct Ascend get of one key: ``[bytes read]`` or ``[code]``."""
        ranges = _multi_ranges([key], [addrs], [sizes])
        if ranges is None:
            return [codes.INVALID_PARAMS]
        return self._get_ranges("batch_get_into_ascend", [key], ranges, exact=True,
                                registered_only=False)

    # --- removal ---

    def remove(self, key: str, force: bool = False) -> int:
        """0; -704 when missing; -706 while a read lease is live (unless ``force``)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """0 / -704 / -706 per key."""
        return self._batch(len(keys), "batch_remove",
                           lambda c: codes.per_key_codes(c.batch_remove(list(keys), force=force)))

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """How many objects whose key matches were removed, or a negative code."""
        return int(self._one("remove_by_regex",
                             lambda c: c.remove_by_regex(regex_pattern, force=force)))

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed, or a negative code."""
        return int(self._one("remove_all", lambda c: c.remove_all(force=force)))

    # --- helpers ---

    def _fits_local_buffer(self, sizes: Sequence[int]) -> bool:
        """Whether each bytes-API value of ``sizes`` bytes fits ``local_buffer_size``
        (Mooncake stages them there and refuses larger ones; kvpool needs no staging but
        answers the same)."""
        client = self._client
        return client is None or all(size <= client.config.local_buffer_size for size in sizes)

    def _own_segment(self, name: str) -> str:
        """Translate a Mooncake segment name to a kvpool segment id (own names -> own segment)."""
        client = self._client
        if client is None or not name:
            return name
        if name in (self._segment_name, client.hostname):
            ids = client.segment_ids
            return str(ids[0]) if ids else ""
        return name

    def _by_address(self, ranges: list[tuple[int, int]]) -> list[Any] | None:
        """Device ranges the client's transfer engine moves in place (no host staging), when
        it has one and every range lies in a registered device region; else None."""
        client = self._client
        if client is None or not client.has_engine:
            return None
        return self._registry.device_ranges(ranges)

    def _one(self, op: str, call: Callable[[Any], T]) -> T | int:
        client = self._client
        if client is None:
            logger.error("%s: the store is not set up (call setup first)", op)
            return codes.INTERNAL_ERROR
        try:
            return call(client)
        except KVPoolError as exc:
            _log_failure(op, exc)
            return codes.code_of_error(exc)

    def _batch(self, count: int, op: str, call: Callable[[Any], list[int]]) -> list[int]:
        result = self._one(op, call)
        return [result] * count if isinstance(result, int) else result

    @staged
    def _put_ranges(self, op: str, keys: Sequence[str], ranges: list[list[tuple[int, int]]],
                    config: ReplicateConfig | None, *, registered_only: bool = True) -> list[int]:
        try:
            options = put_options(config, self._own_segment)
        except KVPoolError as exc:
            _log_failure(op, exc)
            return [codes.code_of_error(exc)] * len(keys)
        results = [codes.OK] * len(keys)
        batch_keys, batch_regions, positions = [], [], []
        registered_only = registered_only and not self._unregistered_ok
        for i, (key, key_ranges) in enumerate(zip(keys, ranges, strict=True)):
            try:
                batch_regions.append(self._by_address(key_ranges) or self._registry.sources(
                    key_ranges, registered_only=registered_only))
            except KVPoolError as exc:
                _log_failure(op, exc)
                results[i] = codes.code_of_error(exc)
                continue
            batch_keys.append(key)
            positions.append(i)
        if batch_keys:
            statuses = self._batch(len(batch_keys), op, lambda c: codes.per_key_codes(
                c.batch_put_regions(batch_keys, batch_regions, options=options)))
            for i, code in zip(positions, statuses, strict=True):
                results[i] = code
        return results

    @staged
    def _get_ranges(self, op: str, keys: Sequence[str], ranges: list[list[tuple[int, int]]], *,
                    exact: bool, registered_only: bool = True) -> list[int]:
        results = [codes.OK] * len(keys)
        batch_keys, dests, positions = [], [], []
        registered_only = registered_only and not self._unregistered_ok
        for i, (key, key_ranges) in enumerate(zip(keys, ranges, strict=True)):
            try:
                addressed = self._by_address(key_ranges)
                dests.append(Destination(addressed, []) if addressed else
                             self._registry.destination(key_ranges,
                                                        registered_only=registered_only))
            except KVPoolError as exc:
                _log_failure(op, exc)
                results[i] = codes.code_of_error(exc)
                continue
            batch_keys.append(key)
            positions.append(i)
        if not batch_keys:
            return results
        read = self._batch(len(batch_keys), op, lambda c: list(
            c.batch_get_regions(batch_keys, [d.views for d in dests])))
        for i, dest, nbytes in zip(positions, dests, read, strict=True):
            results[i] = _read_code(int(nbytes), sum(v.nbytes for v in dest.views), exact)
            if results[i] >= 0:
                try:
                    dest.finish(results[i])
                except KVPoolError as exc:
                    _log_failure(op, exc)
                    results[i] = codes.code_of_error(exc)
        return results


def _real_engine(engine: Any) -> Any:
    """What of ``setup``'s ``engine`` the client can drive: a real Mooncake ``TransferEngine``
    object, used as the client's engine; None for kvpool's own handle, or for the handle a
    real engine's ``get_engine()`` returns (it has no Python surface: the client then starts
    an engine of its own when its config asks for one). Raises KVPoolError INVALID_ARGUMENT for
    anything else."""
    if engine is None or isinstance(engine, EngineHandle):
        return None
    if hasattr(engine, "batch_transfer_sync_write") and hasattr(engine, "get_rpc_port"):
        return engine
    if type(engine).__name__ == "InnerTransferEngine":
        logger.info("setup: the engine handle of mooncake.engine cannot be driven from Python; "
                    "kvpool moves bytes with an engine of its own where its config asks")
        return None
    raise KVPoolError(Status.INVALID_ARGUMENT,
                      "engine must come from mooncake.engine.TransferEngine().get_engine()")


def _fabric_memory_mode(protocol: str, engine: Any) -> bool:
    """Whether ``setup`` was called as vllm-ascend does on A3 hosts with fabric memory: protocol
    ``ascend``, no engine, ``ASCEND_ENABLE_USE_FABRIC_MEM=1`` (its KV caches are then never
    registered)."""
    if protocol != "ascend" or engine is not None or \
            os.environ.get("ASCEND_ENABLE_USE_FABRIC_MEM", "0") != "1":
        return False
    logger.warning("ASCEND_ENABLE_USE_FABRIC_MEM=1: buffers are not registered in this mode; "
                   "kvpool checks each pointer against this process's memory and the device "
                   "runtime, and moves device memory through host memory (no fabric transfers)")
    return True


def _nbytes(value: Any) -> int:
    """The size of a bytes-like value (0 when it is not one: the put itself reports that)."""
    try:
        return memoryview(value).nbytes
    except TypeError:
        return 0


def _ok(_: object) -> int:
    return codes.OK


def _read_code(nbytes: int, capacity: int, exact: bool) -> int:
    if nbytes < 0:
        # kvpool reports a too-small destination as BUFFER_OVERFLOW; Mooncake callers see -600
        return codes.INVALID_PARAMS if nbytes == Status.BUFFER_OVERFLOW else \
            codes.mooncake_code(nbytes)
    if exact and nbytes != capacity:
        return codes.TRANSFER_FAILED  # Mooncake 0.3.13: regions larger than the object
    return nbytes


def _same_lengths(*lists: Sequence[Any]) -> bool:
    return len({len(x) for x in lists}) == 1


def _multi_ranges(keys: Sequence[str], ptrs: Sequence[Sequence[int]],
                  sizes: Sequence[Sequence[int]]) -> list[list[tuple[int, int]]] | None:
    if not _same_lengths(keys, ptrs, sizes):
        return None
    ranges = []
    for key_ptrs, key_sizes in zip(ptrs, sizes, strict=True):
        if len(key_ptrs) != len(key_sizes) or not key_ptrs:
            return None
        ranges.append(list(zip(key_ptrs, key_sizes, strict=True)))
    return ranges


def _log_failure(op: str, exc: KVPoolError) -> None:
    if exc.status in (Status.NOT_FOUND, Status.HAS_LEASE):
        logger.debug("%s: %s", op, exc)
    else:
        logger.error("%s: %s", op, exc)

"""Mooncake's session calls (layer-wise KV save and load): ranged puts and gets across calls.

Put: ``batch_put_session_start`` -> ``batch_put_from_multi_buffer_ranges`` (per layer) ->
``batch_put_session_end`` / ``batch_put_session_revoke``. Get: ``batch_get_session_start`` ->
``batch_get_into_multi_buffer_ranges`` (per layer) -> ``batch_get_session_end``.

Rules of this file:
- Sessions stage through host memory this process owns: a put session collects its ranges in
  a buffer of the object's size and writes the object at ``end`` (kvpool's two-phase put:
  readers never see it before then, and a revoked session leaves nothing); a get session reads
  each object once at ``start`` (its read lease ends when the read is done) and serves ranges
  from that copy. Mooncake moves ranges zero-copy under a reservation and a lease; this costs
  one host copy per object and reports NO_SPACE at ``end`` rather than at ``start``.
- Per-key results as Mooncake: 0 / negative code for start, end and revoke; bytes moved (or a
  negative code) per key for the range calls. A key without an open session, a range outside
  the object, or a buffer outside registered memory is -600 and moves nothing for that key.
- A key whose put session is open is skipped by a second start (it answers 0); a key whose
  object exists answers -705 and opens no session, as Mooncake.
- Sessions are per store and thread-safe; ``close`` drops them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvpool_client.compat import codes
from kvpool_client.compat.replicate import ReplicateConfig, put_options
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions


class _PutSession:
    __slots__ = ("buffer", "options")

    def __init__(self, size_bytes: int, options: PutOptions | None) -> None:
        self.buffer = bytearray(size_bytes)
        self.options = options


class StoreSessions:
    """Mixed into ``MooncakeDistributedStore`` (which provides ``_client``, ``_one``,
    ``_registry``, ``_own_segment`` and ``get_batch``)."""

    def _open_sessions(self) -> None:
        """Set up the session tables (called by the store's constructor)."""
        self._sessions_lock = threading.Lock()
        self._put_sessions: dict[str, _PutSession] = {}
        self._get_sessions: dict[str, bytes] = {}

    def _drop_sessions(self) -> None:
        with self._sessions_lock:
            self._put_sessions.clear()
            self._get_sessions.clear()

    # --- put sessions ---

    def batch_put_session_start(self, keys: Sequence[str], sizes: Sequence[int],
                                config: ReplicateConfig | None = None) -> list[int]:
        """Open a put session per key for an object of ``sizes[i]`` bytes; 0 / code per key."""
        if len(keys) != len(sizes):
            return [codes.INVALID_PARAMS] * len(keys)
        if self._client is None:  # type: ignore[attr-defined]
            return [codes.INTERNAL_ERROR] * len(keys)
        try:
            options = put_options(config, self._own_segment)  # type: ignore[attr-defined]
        except KVPoolError as exc:
            return [codes.code_of_error(exc)] * len(keys)
        results = [codes.OK if isinstance(key, str) and key and isinstance(size, int)
                   and not isinstance(size, bool) and size > 0 else codes.INVALID_PARAMS
                   for key, size in zip(keys, sizes, strict=True)]
        wanted = [i for i, code in enumerate(results) if code == codes.OK]
        found = self._one("batch_put_session_start",  # type: ignore[attr-defined]
                          lambda c: c.batch_exists([keys[i] for i in wanted])) if wanted else []
        if isinstance(found, int):
            return [found if code == codes.OK else code for code in results]
        with self._sessions_lock:
            for i, exists in zip(wanted, found, strict=True):
                if exists:  # as Mooncake: the object is there, no session opens
                    results[i] = int(Status.ALREADY_EXISTS)
                elif keys[i] not in self._put_sessions:
                    self._put_sessions[keys[i]] = _PutSession(sizes[i], options)
        return results

    def batch_put_from_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Copy each key's ranges (registered memory) into its open put session at the given
        object offsets; bytes copied per key, or a negative code."""
        def staging(key: str) -> bytearray | None:
            session = self._put_sessions.get(key)
            return session.buffer if session is not None else None

        return self._ranged(keys, all_buffer_ptrs, all_sizes, all_dst_offsets, staging,
                            self._registry.read_into)  # type: ignore[attr-defined]

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        """Write each session's object (readable from now on) and close the session; 0 / code
        per key (-600 without an open session)."""
        with self._sessions_lock:
            sessions = [self._put_sessions.pop(key, None) for key in keys]
        results = [codes.INVALID_PARAMS if s is None else codes.OK for s in sessions]
        by_options: dict[int, list[int]] = {}
        for i, session in enumerate(sessions):
            if session is not None:
                by_options.setdefault(id(session.options), []).append(i)
        for positions in by_options.values():
            options = sessions[positions[0]].options  # type: ignore[union-attr]
            batch = [keys[i] for i in positions]
            values = [sessions[i].buffer for i in positions]  # type: ignore[union-attr]
            answer = self._one("batch_put_session_end",  # type: ignore[attr-defined]
                               lambda c, b=batch, v=values, o=options: c.put_batch(b, v, options=o))
            statuses = [answer] * len(batch) if isinstance(answer, int) else answer
            for i, status in zip(positions, statuses, strict=True):
                results[i] = codes.OK if status in (Status.OK, Status.ALREADY_EXISTS) else \
                    codes.mooncake_code(status)
        return results

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        """Abandon each open put session (nothing is written); 0, or -600 without one."""
        with self._sessions_lock:
            return [codes.OK if self._put_sessions.pop(key, None) is not None
                    else codes.INVALID_PARAMS for key in keys]

    # --- get sessions ---

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Read each object once for the ranged gets that follow; 0, -704 when missing, or a
        code per key."""
        if self._client is None:  # type: ignore[attr-defined]
            return [codes.INTERNAL_ERROR] * len(keys)
        datas = self.get_batch(list(keys)) if keys else []  # type: ignore[attr-defined]
        results: list[int] = []
        with self._sessions_lock:
            for key, data in zip(keys, datas, strict=True):
                if data:
                    self._get_sessions[key] = data
                    results.append(codes.OK)
                else:
                    results.append(codes.NOT_FOUND)
        return results

    def batch_get_into_multi_buffer_ranges(self, keys: Sequence[str],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]) -> list[int]:
        """Copy byte ranges of each key's session object into registered buffers; bytes copied
        per key, or a negative code."""
        return self._ranged(keys, all_buffer_ptrs, all_sizes, all_src_offsets,
                            self._get_sessions.get,
                            self._registry.write_at)  # type: ignore[attr-defined]

    def _ranged(self, keys: Sequence[str], all_buffer_ptrs: Sequence[Sequence[int]],
                all_sizes: Sequence[Sequence[int]], all_offsets: Sequence[Sequence[int]],
                session_of: Callable[[str], Any], move: Callable[[int, memoryview], None]
                ) -> list[int]:
        """Run ``move(buffer address, the object's range)`` for every range of every key whose
        session ``session_of`` finds (the object's bytes); bytes moved per key, or a code."""
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_offsets):
            return [codes.INVALID_PARAMS] * len(keys)
        results: list[int] = []
        for key, ptrs, sizes, offsets in zip(keys, all_buffer_ptrs, all_sizes, all_offsets,
                                             strict=True):
            with self._sessions_lock:
                target = session_of(key)
            if target is None or not _ranges_fit(ptrs, sizes, offsets, len(target)):
                results.append(codes.INVALID_PARAMS)
                continue
            whole = memoryview(target)
            try:
                for ptr, size, offset in zip(ptrs, sizes, offsets, strict=True):
                    move(ptr, whole[offset:offset + size])
            except KVPoolError as exc:
                results.append(codes.code_of_error(exc))
                continue
            results.append(sum(sizes))
        return results

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        """Close the get sessions of ``keys``; 0."""
        with self._sessions_lock:
            for key in keys:
                self._get_sessions.pop(key, None)
        return codes.OK


def _ranges_fit(ptrs: Sequence[Any], sizes: Sequence[Any], offsets: Sequence[Any],
                object_bytes: int) -> bool:
    """Ranges of equal counts, non-negative ints, each inside the object."""
    if not len(ptrs) == len(sizes) == len(offsets) or not ptrs:
        return False
    for ptr, size, offset in zip(ptrs, sizes, offsets, strict=True):
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                   for v in (ptr, size, offset)):
            return False
        if size == 0 or offset + size > object_bytes:
            return False
    return True

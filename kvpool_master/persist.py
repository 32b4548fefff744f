"""Durable index of kvpool-master (``--state-dir DIR``): a snapshot plus an append-only log.

API (server.py wires it; every call is synchronous and made from the event loop thread)::

    store = StateStore(state_dir, fsync="batch", fsync_interval_s=0.05,
                       restore_grace_s=30.0, compact_log_bytes=64 << 20,
                       compact_log_ratio=0.25)
    report = store.load(core, now)       # once, into a fresh MasterCore, before serving
    ok = store.record(core, events)      # every list drained with core.take_events(): append,
                                         # compact when due, sync when the events demand it;
                                         # False: the answer of that call must not go out
    store.flush(core)                    # now and then (tick loop): fsync what "batch" left
    store.compact(core)                  # a full snapshot; the way out of read-only mode
    delay = store.compact_step(core)     # between calls while it is not None (a background
                                         # compaction and what it held back, in steps)
    store.close()

A compaction is due once the log has grown past ``compact_log_bytes`` and past
``compact_log_ratio`` times the size of the snapshot it applies to. The second bound keeps the
cost of compacting proportional to the change it folds in: each compaction writes the whole
index again (seconds for millions of objects), so a big index compacted every 64 MiB of log
would be rewriting itself all the time under churn. Restore then reads at most the snapshot
and a log of ``compact_log_ratio`` times its size.

With ``background=True`` (the server's choice), a compaction that the log's size calls for
(``maybe_compact``) does not hold the caller: it is written between calls, one short step at a
time (``compact_step``, which the server runs whenever the loop has nothing else to do), and
the master goes on logging to the current log meanwhile:

- it starts with the clients and segments as they are, and notes the log's size;
- each step writes the rows of the next ``_OBJECTS_PER_CHUNK`` objects of the index in LRU
  order as of the start (``MasterCore.start_snapshot``). A row shows its object as it is when
  its step comes, so the snapshot is fuzzy: an object changed meanwhile may show either way,
  or not at all if it went;
- then steps copy the log records written since the start into the file as its tail
  (``statefile.py``), up to ``_TAIL_STEP_BYTES`` a step; once nearly caught up, a thread
  fsyncs the file while the loop goes on; a last step copies the rest, fsyncs what is new,
  renames it into place and starts the new log.

Restore applies the tail on top of the rows, and every change since the start is in it: a
commit row carries the object's whole state and a removal is idempotent, so the result is the
index at the rename, whatever the rows showed. No child is forked: a fork copies the
page tables of the whole master on the loop (about 12–19 ms a GiB of resident memory), which
no step here comes near, and needs no memory beyond the step's rows. Reads during the
compaction move their objects to the recent end only after it (``MasterCore.settle``, in
steps too). A crash before the rename leaves the old snapshot and log, which hold everything.
An explicit ``compact`` (the way out of read-only mode) abandons a compaction in progress and
snapshots in the caller.

Files in ``state_dir``: ``snapshot.kvp`` and ``log.kvp`` (records and replay:
``statefile.py``). Both are sequences of records
``u32 LE payload length | u32 LE crc32(payload) | msgpack payload``. The first record of each
is a header ``{"format": ..., "version": V, "generation": G}`` (a log's V is 2, and 1 still
restores; a snapshot's is 3, and 1 and 2 still restore). The snapshot holds clients, segments
and READY objects (chunks of rows, or of columns for objects with one replica, see
``statefile.py``) and an end record; the log holds one record per ``append`` call (a list of
event rows, each run of commits with one replica or of removals as one row of columns). An
older master that reads neither version sets the snapshot aside and discards the log: it
starts empty, and serves no bytes the files no longer describe. The log applies on top of
the snapshot of the same generation only. The snapshot and log a compaction replaced stay as
``snapshot.kvp.old`` and ``log.kvp.old`` until a thread unlinks them (freeing a big file's
blocks takes a while); ``load`` removes any a crash left.

Durability (``fsync``):
- ``"always"``: every ``append`` is fsynced before it returns.
- ``"batch"`` (default): records are written (to the page cache) at once, so a killed master
  loses nothing; fsync runs when ``fsync_interval_s`` has passed since the last one (on
  ``append`` or ``flush``), so a machine crash loses at most that much.
- ``"never"``: no fsync of the log (the operating system writes it back when it likes).
Compaction writes the new snapshot to a temporary file, fsyncs it, renames it into place,
fsyncs the directory, then starts an empty log of the new generation the same way. A crash at
any point leaves either the old snapshot and log or the new snapshot (and its log, or none).

Freed bytes are not handed out again before their freeing is durable (``load`` switches the
core to ``track_durability``). A ``put_start`` whose placement may reuse bytes freed by a record
not yet synced ends its events with ``SyncRequired``: ``record`` then fsyncs before the answer
goes out, and tells the core (``mark_durable``) after every fsync and snapshot. So after a
power cut the log never brings back an object whose bytes a later object overwrote: with
``"always"`` this costs nothing more; with ``"batch"`` at most one fsync per call that reuses
freshly freed bytes (typically one per eviction pass). With ``"never"`` a record counts as
durable once written to the page cache: that survives a killed master, not a power cut, and
``"never"`` promises nothing across one (placements may reuse bytes whose removal is lost).

Read-only mode: any failed write to the state directory (a log append, ENOSPC, EIO, a short
write, a failed fsync or snapshot) makes the log untrustworthy from that record on, so from
then on nothing is appended (later, smaller records would land after a hole: removed objects
would come back on restore and point at reused bytes). ``healthy`` turns False and stays so
until a full snapshot (``compact``) succeeds; the server refuses every call that changes
durable state meanwhile (UNAVAILABLE), retries the snapshot with back-off, and reports it.
The rule that keeps this sound: while read-only the in-memory index may still drop things
(expiry, eviction, reclaim of stale puts, released leases), but nothing is allocated, so no
byte freed after the failure is reused; if the master dies before the snapshot, restore brings
back the last durable state, whose objects still hold their own bytes. The call whose write
failed answers normally unless it ended with ``SyncRequired`` (its placements are withheld).
The snapshot that ends read-only mode captures the in-memory index wholesale and becomes the
truth.

Restore: clients (with their capability keys), segments and READY objects come back. Restored
clients must register again and mount their segments again (identical descriptors) within
``restore_grace_s``; objects on segments that are not back in time are dropped. Leases are not
persisted (they last seconds and no reader survives a master restart with a lease the new
master must honour). PENDING objects are not persisted: their writers see UNKNOWN_CLIENT,
re-register and put again, and a half-written object must never become readable.

Restore never resolves two objects claiming one extent: both are dropped and counted
(``num_conflicting_objects``, logged). The free space of restored segments is quarantined for
``write_capability_ttl_s`` (see ``MasterCore.restore``).

A torn or corrupt record (short header, impossible length, bad crc, undecodable payload) ends
the log: it is truncated there with a warning. A corrupt snapshot is set aside
(``snapshot.kvp.corrupt``) with a warning; what was read before the damage is kept. Nothing
here raises on bad files; ``OSError`` from the file system propagates from ``load``, and from
``record``, ``flush`` and ``compact`` (the store is then read-only, see above).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvpool_master.core import events as ev
from kvpool_master.core.master import MasterCore
from kvpool_master.core.snapshot import Snapshot
from kvpool_master.statefile import (
    SNAPSHOT_VERSION,
    VERSION,
    VERSIONS,
    Corrupt,
    Overlay,
    chunk_frame,
    chunk_len,
    frame,
    log_rows,
    next_record,
    read_snapshot_head,
    read_snapshot_objects,
    read_snapshot_tail,
    tail_trailer,
    whole_records_bytes,
)

log = logging.getLogger("kvpool.master.persist")

SNAPSHOT_NAME = "snapshot.kvp"
LOG_NAME = "log.kvp"
#: A replaced snapshot or log keeps this suffix until a thread unlinks it (see ``_install``).
RETIRED_SUFFIX = ".old"
FSYNC_POLICIES = ("always", "batch", "never")
#: Objects per record of a snapshot, and so per step of a background compaction (about 2 to
#: 4 ms a step at millions of objects, where the entries are cold in the CPU caches).
_OBJECTS_PER_CHUNK = 2048
#: A stepped compaction copies at most this much of the log into its tail in one step, and
#: syncs its file (in a thread) once less than this is left to copy.
_TAIL_STEP_BYTES = 1 << 20
#: How often a step looks whether that sync is done (seconds).
_SYNC_POLL_S = 0.005
#: Objects read during a stepped compaction moved to the recent end in one step afterwards.
_SETTLE_STEP = 16384


@dataclass(slots=True)
class _Stepped:
    """A compaction written a step at a time between calls (see the module docstring)."""

    generation: int
    path: Path          # the snapshot being written (renamed into place at the end)
    file: BinaryIO
    log: BinaryIO       # the current log, read back into the tail
    log_offset: int     # the log's size at the start: what follows becomes the tail
    started_s: float
    num_objects: int = 0
    tail_offset: int = -1   # where the tail starts in ``file``; -1 while objects are written
    copied: int = 0         # log bytes copied into the tail so far
    sync: threading.Thread | None = None
    sync_error: OSError | None = None
    longest_step_s: float = 0.0
    longest_step_cpu_s: float = 0.0   # the CPU time of that step (the rest: preempted)
    step_started_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Compaction:
    """A finished compaction, as the metrics show the last one."""

    seconds: float              # from its start to its swap
    num_objects: int
    longest_step_s: float       # the longest time it held the loop (all of it when not stepped)
    last_step_s: float          # the step that synced and swapped


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """What ``StateStore.load`` found and restored."""

    num_clients: int
    num_segments: int
    num_objects: int
    num_dropped_rows: int         # malformed rows the core refused
    num_log_records: int          # log records replayed on top of the snapshot
    truncated_log_bytes: int      # torn or corrupt log tail cut off
    generation: int
    warnings: tuple[str, ...]
    num_conflicting_objects: int = 0  # dropped: their extents overlapped another object's


class StateStore:
    """Snapshot + append-only log of one master's index in ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike[str], fsync: str = "batch",
                 fsync_interval_s: float = 0.05, restore_grace_s: float = 30.0,
                 compact_log_bytes: int = 64 << 20, background: bool = False,
                 compact_log_ratio: float = 0.25) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if not fsync_interval_s >= 0 or not restore_grace_s >= 0 or compact_log_bytes < 1 \
                or not 0 <= compact_log_ratio <= 100:
            raise ValueError("fsync_interval_s, restore_grace_s must be >= 0, "
                             "compact_log_bytes >= 1 and compact_log_ratio in [0, 100]")
        self._dir = Path(state_dir)
        self._fsync = fsync
        self._fsync_interval_s = fsync_interval_s
        self._restore_grace_s = restore_grace_s
        self._compact_log_bytes = compact_log_bytes
        self._compact_log_ratio = compact_log_ratio
        self._snapshot_bytes = 0  # size of the snapshot the log applies to
        self._generation = 0
        self._fd = -1
        self._log_bytes = 0
        self._unsynced = False
        self._synced_bytes = 0
        self._last_sync_s = time.monotonic()
        self._failure = ""   # why the state directory is untrustworthy; "" when healthy
        self._background = background
        self._stepped: _Stepped | None = None
        # after a failed background compaction, the next waits for this much log
        self._retry_at_log_bytes = 0
        self.num_compactions = 0   # finished, since start
        self.last_compaction: Compaction | None = None

    @property
    def log_bytes(self) -> int:
        """Current size of the log file in bytes."""
        return self._log_bytes

    @property
    def synced_log_bytes(self) -> int:
        """Size of the log at its last fsync: what survives a power cut (policy permitting)."""
        return self._synced_bytes

    @property
    def compact_at_log_bytes(self) -> int:
        """The log size at which a compaction is due (see the module docstring)."""
        return max(self._compact_log_bytes,
                   int(self._snapshot_bytes * self._compact_log_ratio))

    @property
    def compacting(self) -> bool:
        """True while a compaction is written in steps (``compact_step``)."""
        return self._stepped is not None

    @property
    def healthy(self) -> bool:
        """False from a failed write until a snapshot succeeds (read-only mode)."""
        return not self._failure

    @property
    def failure(self) -> str:
        """Why the store is read-only ("" when healthy)."""
        return self._failure

    # ---- load ----------------------------------------------------------------------------

    def load(self, core: MasterCore, now: float,
             on_rows: Callable[[int], None] | None = None) -> RestoreReport:
        """Restore the saved index into the fresh ``core`` and open the log for appending;
        ``on_rows(n)`` as each record of ``n`` snapshot rows is read (progress).

        Returns what was restored. A missing directory or files mean an empty index.
        """
        self._dir.mkdir(parents=True, exist_ok=True)
        _keep_private(self._dir)
        _unlink_all([self._dir / (name + RETIRED_SUFFIX) for name in (SNAPSHOT_NAME, LOG_NAME)])
        warnings: list[str] = []
        snapshot_path = self._dir / SNAPSHOT_NAME
        generation = 0
        clients: dict[str, Sequence[Any]] = {}
        segments: dict[str, Sequence[Any]] = {}
        snapshot_file: BinaryIO | None = None
        lost_snapshot = False
        if snapshot_path.exists():
            snapshot_file = snapshot_path.open("rb")
            self._snapshot_bytes = os.fstat(snapshot_file.fileno()).st_size
            try:
                generation, clients, segments = read_snapshot_head(snapshot_file)
            except Corrupt as exc:
                snapshot_file.close()
                snapshot_file = None
                lost_snapshot = True
                warnings.append(self._set_aside(snapshot_path, str(exc)))
        tail = (read_snapshot_tail(snapshot_file, warnings)
                if snapshot_file is not None else [])
        log_records, truncated, generation = self._read_log(generation, lost_snapshot,
                                                            warnings)
        log_records = tail + log_records
        # Restoring creates millions of long-lived objects; the cyclic collector would rescan
        # them over and over (half the restore time at 100k objects); an object leaving the
        # table unlinks itself, so the collector is not needed to free it.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        overlay = Overlay(clients, segments)
        for record in log_records:
            overlay.apply(record)
        num_log_records = len(log_records)
        try:
            snapshot_rows = (read_snapshot_objects(snapshot_file, warnings, on_rows)
                             if snapshot_file is not None else iter(()))
            objects = overlay.objects(snapshot_rows)
            # The log's part is built: let the decoded log go before the snapshot restores
            # (a log at its compaction limit decodes to about a gigabyte at 10 M objects).
            del log_records
            overlay.drop_log()
            counts = core.restore(Snapshot(list(overlay.clients.values()),
                                           list(overlay.segments.values()), objects),
                                  now, self._restore_grace_s)
        finally:
            if gc_was_enabled:
                # Nothing in the restored index needs the collector: keep it from walking
                # it (a full collection of a million objects takes about half a second).
                gc.freeze()
                gc.enable()
            if snapshot_file is not None:
                snapshot_file.close()
            _return_free_heap()
        self._generation = generation
        self._open_log(fresh=not (self._dir / LOG_NAME).exists())
        core.track_durability()
        if counts.num_conflicting_objects:
            warnings.append(f"{counts.num_conflicting_objects} objects claimed extents that "
                            f"overlap another object's: all of them were dropped")
        for message in warnings:
            log.warning("%s", message)
        return RestoreReport(counts.num_clients, counts.num_segments, counts.num_objects,
                             counts.num_dropped_rows, num_log_records, truncated, generation,
                             tuple(warnings), counts.num_conflicting_objects)

    def _read_log(self, generation: int, any_generation: bool,
                  warnings: list[str]) -> tuple[list[list[Any]], int, int]:
        """Return the event records of the log of ``generation`` (of any generation when the
        snapshot was lost: it is all that is left), the bytes cut off, and the generation."""
        path = self._dir / LOG_NAME
        if not path.exists():
            return [], 0, generation
        data = path.read_bytes()
        records: list[list[Any]] = []
        offset = 0
        header, offset, problem = next_record(data, 0)
        if (problem or not isinstance(header, dict) or header.get("format") != "kvpool-log"
                or header.get("version") not in VERSIONS):
            warnings.append(f"{path}: unreadable log header ({problem or 'wrong header'}); "
                            f"discarding {len(data)} bytes")
            path.unlink()
            return [], len(data), generation
        if any_generation and type(header.get("generation")) is int:
            generation = header["generation"]
        if header.get("generation") != generation:
            # Left by a compaction that crashed after its snapshot was in place: everything in
            # it is in the snapshot already.
            path.unlink()
            return [], 0, generation
        good = offset
        while offset < len(data):
            record, offset, problem = next_record(data, offset)
            if problem or not isinstance(record, list):
                warnings.append(f"{path}: {problem or 'malformed record'} at byte {good}; "
                                f"truncating {len(data) - good} bytes")
                with path.open("r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
                return records, len(data) - good, generation
            records.append(record)
            good = offset
        return records, 0, generation

    def _set_aside(self, path: Path, reason: str) -> str:
        aside = path.with_name(path.name + ".corrupt")
        os.replace(path, aside)
        return f"{path}: {reason}; moved to {aside.name}, starting from the log alone"

    # ---- append --------------------------------------------------------------------------

    def record(self, core: MasterCore, events: Sequence[ev.Event]) -> bool:
        """Log ``events`` (just taken from ``core``), compact when due, fsync when they end
        with ``SyncRequired``, and tell ``core`` what is durable. Return False when the answer
        of the call that produced them must not go out (its placements may reuse bytes whose
        freeing is not durable, and the store is read-only).

        Never raises: a failed write makes the store read-only (``healthy`` False, logged
        once). While read-only nothing is written: the snapshot that ends it carries it all.
        """
        sync_required = bool(events) and type(events[-1]) is ev.SyncRequired
        if self._failure:
            return not sync_required
        try:
            self.append(events)
            self.maybe_compact(core)
            if sync_required and self._unsynced and self._fsync != "never":
                self._sync()
        except OSError:
            return not sync_required
        if not self._unsynced or self._fsync == "never":
            core.mark_durable(core.free_seq)
        return True

    def append(self, events: Sequence[ev.Event]) -> None:
        """Log the durable ones among ``events`` as one record; fsync per the policy.

        Raises OSError when the write fails, and at once while read-only (``healthy``).
        """
        if self._fd < 0 and not self._failure:
            raise RuntimeError("StateStore.append before load() or after close()")
        if self._failure:
            raise OSError(f"state log is read-only after a failed write: {self._failure}")
        rows = log_rows(events)
        if not rows:
            return
        record = frame(rows)
        try:
            written = os.write(self._fd, record)
            if written != len(record):
                raise OSError(f"short write ({written} of {len(record)} bytes)")
        except OSError as exc:
            self._fail(exc)
            # Leave no partial record behind (best effort: nothing is appended after it).
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._log_bytes)
            raise
        self._log_bytes += len(record)
        self._unsynced = True
        due = (self._fsync == "always"
               or (self._fsync == "batch"
                   and time.monotonic() - self._last_sync_s >= self._fsync_interval_s))
        if due:
            self._sync()

    def flush(self, core: MasterCore | None = None) -> None:
        """Fsync the log now if anything is unsynced (a no-op for ``fsync="never"`` and while
        read-only), then tell ``core`` that everything logged is durable. Never raises (a
        failed fsync makes the store read-only)."""
        if self._fd >= 0 and self._unsynced and self._fsync != "never" and not self._failure:
            with contextlib.suppress(OSError):
                self._sync()
        if core is not None and not self._failure and not (
                self._unsynced and self._fsync != "never"):
            core.mark_durable(core.free_seq)

    def _sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as exc:
            # After a failed fsync the kernel may have dropped the dirty pages: nothing in
            # the log since the last good fsync can be trusted.
            self._fail(exc)
            raise
        self._unsynced = False
        self._synced_bytes = self._log_bytes
        self._last_sync_s = time.monotonic()

    def _fail(self, exc: OSError) -> None:
        if not self._failure:
            self._failure = f"{type(exc).__name__}: {exc}"
            log.error("cannot write the state directory %s (%s): read-only until a full "
                      "snapshot succeeds; calls that change the index answer UNAVAILABLE",
                      self._dir, self._failure)

    # ---- compaction ----------------------------------------------------------------------

    def maybe_compact(self, core: MasterCore) -> bool:
        """Compact when the log has grown past ``compact_log_bytes``; return whether it did.

        Call it right after ``append`` of every event taken from ``core`` so far.
        """
        if self._stepped is not None or self._log_bytes < max(self.compact_at_log_bytes,
                                                              self._retry_at_log_bytes):
            return False
        if self._background:
            if not core.settling:  # the last one's held-back reads are not all moved yet
                self._start_stepped(core)
            return False
        self.compact(core)
        return True

    def compact(self, core: MasterCore) -> None:
        """Write a snapshot of ``core`` and start an empty log of the next generation.

        Success makes the store healthy again (the snapshot is the whole truth) and marks
        every free of ``core`` durable. Raises OSError (the store is then read-only; the
        temporary file is removed so that a full disk gets its space back).
        """
        self._abandon_stepped(core)
        started_s = time.monotonic()
        core.settle(None)
        generation = self._generation + 1
        tmp = self._dir / (SNAPSHOT_NAME + ".tmp")
        try:
            num_objects = self._write_snapshot(core, tmp, generation)
            self._install(tmp, generation)
        except OSError as exc:
            self._fail(exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise
        self._failure = ""
        core.mark_durable(core.free_seq)
        took_s = time.monotonic() - started_s
        self._finished(Compaction(took_s, num_objects, took_s, took_s))

    def _finished(self, compaction: Compaction) -> None:
        self.num_compactions += 1
        self.last_compaction = compaction

    def _start_stepped(self, core: MasterCore) -> None:
        """Start a compaction written in steps: its head now, its objects and tail later."""
        generation = self._generation + 1
        path = self._dir / (SNAPSHOT_NAME + ".tmp")
        started_s = time.monotonic()
        try:
            file = _create(path)
        except OSError as exc:
            self._retry_later(generation, f"cannot start ({exc})")
            return
        try:
            log_file = (self._dir / LOG_NAME).open("rb")
        except OSError as exc:
            file.close()
            self._retry_later(generation, f"cannot start ({exc})")
            return
        stepped = _Stepped(generation, path, file, log_file, self._log_bytes, started_s)
        self._stepped = stepped
        head = core.start_snapshot()
        try:
            self._write_head(file, generation, head)
        except OSError as exc:
            self._abandon_stepped(core, f"failed ({exc})")
            return
        log.info("compacting the state log in steps between calls (generation %d)",
                 generation)

    def compact_step(self, core: MasterCore) -> float | None:
        """Run one step of the compaction started by ``maybe_compact`` (``_OBJECTS_PER_CHUNK``
        objects, or up to ``_TAIL_STEP_BYTES`` of log), or of moving the objects read
        meanwhile (``MasterCore.settle``). Returns None when nothing is left to do, else the
        seconds until the next step is worth running (0.0: at once). Never raises: a failed
        compaction is logged and dropped (the log goes on; the next growth tries again)."""
        stepped = self._stepped
        if stepped is None:
            return 0.0 if core.settle(_SETTLE_STEP) else None
        if self._failure:
            self._abandon_stepped(core, "outlived a failed write")
            return 0.0
        stepped.step_started_s = time.monotonic()
        cpu_started_s = time.thread_time()
        try:
            delay = self._advance(core, stepped)
        except OSError as exc:
            self._abandon_stepped(core, f"failed ({exc})")
            return 0.0
        took_s = time.monotonic() - stepped.step_started_s
        if took_s > stepped.longest_step_s:
            stepped.longest_step_s = took_s
            stepped.longest_step_cpu_s = time.thread_time() - cpu_started_s
        return delay

    def _advance(self, core: MasterCore, stepped: _Stepped) -> float:
        file = stepped.file
        if stepped.tail_offset < 0:
            chunks = core.snapshot_step(_OBJECTS_PER_CHUNK)
            if chunks is None:
                file.write(frame({"end": True, "num_objects": stepped.num_objects}))
                stepped.tail_offset = file.tell()
            else:
                for chunk in chunks:
                    file.write(chunk_frame(chunk))
                    stepped.num_objects += chunk_len(chunk)
            return 0.0
        if stepped.sync is not None and stepped.sync.is_alive():
            return _SYNC_POLL_S
        self._copy_tail(stepped, _TAIL_STEP_BYTES)
        left = self._log_bytes - stepped.log_offset - stepped.copied
        if stepped.sync is None:
            if left < _TAIL_STEP_BYTES:  # sync the bulk of it off the loop
                file.flush()
                stepped.sync = threading.Thread(target=_sync_in_thread, args=(stepped,),
                                                name="kvpool-snapshot-sync", daemon=True)
                stepped.sync.start()
            return 0.0
        if stepped.sync_error is not None:
            raise stepped.sync_error
        if left:
            return 0.0
        # caught up: what is left to sync is what came since the thread's sync
        file.write(tail_trailer(stepped.tail_offset))
        file.flush()
        os.fsync(file.fileno())
        self._close_stepped(stepped)
        self._stepped = None
        try:
            self._install(stepped.path, stepped.generation)
        except OSError as exc:
            self._fail(exc)  # half swapped, maybe: only a full snapshot is trusted now
            with contextlib.suppress(OSError):
                stepped.path.unlink(missing_ok=True)
            return 0.0
        core.mark_durable(core.free_seq)
        done_s = time.monotonic()
        last_step_s = done_s - stepped.step_started_s
        done = Compaction(done_s - stepped.started_s, stepped.num_objects,
                          max(stepped.longest_step_s, last_step_s), last_step_s)
        self._finished(done)
        log.info("background compaction done in %.2f s (generation %d, %d objects; %d bytes "
                 "of changes made meanwhile carried as its tail; longest step %.1f ms, of "
                 "which %.1f ms on the CPU; the last one, which syncs and swaps, %.1f ms)",
                 done.seconds, stepped.generation, done.num_objects, stepped.copied,
                 stepped.longest_step_s * 1e3, stepped.longest_step_cpu_s * 1e3,
                 done.last_step_s * 1e3)
        return 0.0

    def _copy_tail(self, stepped: _Stepped, max_bytes: int) -> None:
        """Copy up to ``max_bytes`` of whole log records written since the compaction
        started into its tail."""
        stepped.log.seek(stepped.log_offset + stepped.copied)
        data = stepped.log.read(min(max_bytes, self._log_bytes - stepped.log_offset
                                    - stepped.copied))
        whole = whole_records_bytes(data)
        if not whole and data:  # one record longer than a step: copy it whole
            stepped.log.seek(stepped.log_offset + stepped.copied)
            data = stepped.log.read(self._log_bytes - stepped.log_offset - stepped.copied)
            whole = whole_records_bytes(data)
        stepped.file.write(memoryview(data)[:whole])
        stepped.copied += whole

    def _abandon_stepped(self, core: MasterCore, why: str = "") -> None:
        """Drop a compaction in progress and its file (its held-back reads still settle)."""
        stepped = self._drop_stepped()
        if stepped is None:
            return
        core.end_snapshot()
        if why:
            self._retry_later(stepped.generation, why)

    def _drop_stepped(self) -> _Stepped | None:
        """Forget the compaction in progress, if any: close and remove its file."""
        stepped, self._stepped = self._stepped, None
        if stepped is not None:
            self._close_stepped(stepped)
            with contextlib.suppress(OSError):
                stepped.path.unlink(missing_ok=True)
        return stepped

    def _retry_later(self, generation: int, why: str) -> None:
        """A background compaction failed: the next waits until the log has grown by
        ``compact_log_bytes`` again (a full disk is not rewritten at every call)."""
        self._retry_at_log_bytes = self._log_bytes + self._compact_log_bytes
        log.warning("background compaction (generation %d) %s; the log goes on, the next "
                    "try once it has grown by %d bytes", generation, why,
                    self._compact_log_bytes)

    @staticmethod
    def _close_stepped(stepped: _Stepped) -> None:
        if stepped.sync is not None:
            stepped.sync.join()  # never close a file a sync is running on
        stepped.log.close()
        stepped.file.close()

    def _install(self, path: Path, generation: int) -> None:
        """Put the written and synced snapshot at ``path`` in place and start the empty log of
        its ``generation`` (raises OSError)."""
        # The replaced snapshot and log keep a second name until a thread unlinks them:
        # the kernel frees a file's blocks as its last name goes, in proportion to its size,
        # so replacing the files of an index of millions of objects would hold the loop for
        # a large part of a second (README, the scale row: swaps of up to 179 ms).
        retired = [self._retire(name) for name in (SNAPSHOT_NAME, LOG_NAME)]
        os.replace(path, self._dir / SNAPSHOT_NAME)
        self._sync_dir()
        self._generation = generation
        self._snapshot_bytes = (self._dir / SNAPSHOT_NAME).stat().st_size
        self._open_log(fresh=True)
        threading.Thread(target=_unlink_all, args=([p for p in retired if p is not None],),
                         name="kvpool-state-unlink", daemon=True).start()

    def _retire(self, name: str) -> Path | None:
        """Give the file ``name`` a second name (``name.old``) to unlink later; None when it
        does not exist."""
        current, old = self._dir / name, self._dir / (name + RETIRED_SUFFIX)
        old.unlink(missing_ok=True)  # left by a crash (load removes them too)
        try:
            os.link(current, old)
        except FileNotFoundError:
            return None
        return old

    def _write_snapshot(self, core: MasterCore, path: Path, generation: int) -> int:
        """Write ``core``'s snapshot to ``path`` in one go and fsync it; return how many
        objects it holds."""
        snapshot = core.snapshot()
        with _create(path) as f:
            self._write_head(f, generation, snapshot)
            num_objects = 0
            for chunk in core.snapshot_chunks(_OBJECTS_PER_CHUNK):
                f.write(chunk_frame(chunk))
                num_objects += chunk_len(chunk)
            f.write(frame({"end": True, "num_objects": num_objects}))
            f.flush()
            os.fsync(f.fileno())
        return num_objects

    @staticmethod
    def _write_head(f: BinaryIO, generation: int, snapshot: Snapshot) -> None:
        f.write(frame({"format": "kvpool-snapshot", "version": SNAPSHOT_VERSION,
                        "generation": generation}))
        f.write(frame([list(c) for c in snapshot.clients]))
        f.write(frame([list(s) for s in snapshot.segments]))

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Fsync (unless ``fsync="never"`` or read-only) and close the log. Idempotent. A
        compaction still running in steps is abandoned."""
        self._drop_stepped()
        if self._fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = -1

    def _open_log(self, fresh: bool) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        path = self._dir / LOG_NAME
        if fresh:
            tmp = self._dir / (LOG_NAME + ".tmp")
            with _create(tmp) as f:
                f.write(frame({"format": "kvpool-log", "version": VERSION,
                                "generation": self._generation}))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._sync_dir()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._log_bytes = self._synced_bytes = os.fstat(self._fd).st_size
        self._unsynced = False

    def _sync_dir(self) -> None:
        fd = os.open(self._dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _return_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op
    elsewhere). What a restore decoded and built before the index it keeps (a log, chunks
    of columns) leaves holes below it that the heap cannot shrink past: 208-221 MiB at
    10 M objects with a log at its compaction limit (``master_core.py --restore``'s RSS
    after the restore, with this call and without)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _create(path: Path) -> BinaryIO:
    """``path`` opened for writing from empty, readable by this user only (0600 whatever the
    process's umask: the files hold every client's capability key)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _keep_private(directory: Path) -> None:
    """Make ``directory`` and what it holds readable by this user only (it holds every
    client's capability key): a directory made by a service manager or by an older master
    may be open to others. Files of other owners are left as they are."""
    uid = os.getuid()
    for path in (directory, *directory.iterdir()):
        with contextlib.suppress(OSError):
            info = path.lstat()
            if info.st_uid == uid and not stat.S_ISLNK(info.st_mode):
                path.chmod(0o700 if stat.S_ISDIR(info.st_mode) else 0o600)


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _sync_in_thread(stepped: _Stepped) -> None:
    """Fsync a stepped compaction's file (off the loop: it may hold gigabytes not yet
    written back)."""
    try:
        os.fsync(stepped.file.fileno())
    except OSError as exc:
        stepped.sync_error = exc

"""Tier copies: the demotions and promotions the master asks of this client.

Rules of this file:
- The master never moves bytes: when it wants an object of one of this client's DRAM
  segments copied to one of its SSD segments (or back), it hands this client's copier thread
  a task. The copier keeps one ``CopyTasks`` call at the master: it reports the results of
  the last batch and waits there (up to ``wait_s``) until tasks come, so a burst of puts is
  met within the master's pass interval, not a poll interval, while an idle copier costs one
  call per ``wait_s``. A master that answers at once (it does not wait) gets the same pace
  from a local wait, which a heartbeat saying copies wait cuts short. A partitioned master
  hands out the copies of each partition's objects: the copier keeps one such call, on a
  thread of its own, at each partition (``partitions()`` says how many; a thread starts for
  each partition the master has when the copier starts or a heartbeat pokes it).
- Both ends of a copy are this client's own segments: no capability, no network. The copies
  of one batch run on ``ssd_copy_threads`` threads, so several SSD writes are in flight.
- A copy is started only within the time the master gave (``start_within_s`` from when the
  answer arrived): a later one is reported TIMEOUT, never made, since the master may have
  handed the target to someone else by then. A copy checks the object's checksum (when it
  has one) over the bytes it moved, and reports CHECKSUM_MISMATCH instead of committing bytes
  that are not the object's.
- The copier stops with the client: a call of its own that fetches nothing ends the wait
  at the master, and tasks handed out but not made are reported so (their targets are freed
  at once). Results it could not report are dropped (the master drops those tasks at their
  ttl).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping

from kvpool_client.core.regions import checksum
from kvpool_client.metrics import ClientMetrics
from kvpool_client.segments import LocalSegment
from kvpool_client.ssd import SsdSegment
from kvpool_wire.calls import CopyTask
from kvpool_wire.status import KVPoolError, Status

logger = logging.getLogger(__name__)

#: Most tasks fetched per call.
MAX_TASKS_PER_CALL = 64
#: An error from the master: ask again after this long.
RETRY_AFTER_S = 1.0


class TierCopier:
    """Makes the tier copies the master asks of this client, on its own threads."""

    def __init__(self, client_id: str, stub: Callable[[], object],
                 dram: Mapping[str, LocalSegment], ssd: Mapping[str, SsdSegment],
                 threads: int, metrics: ClientMetrics, wait_s: float = 2.0,
                 partitions: Callable[[], int] = lambda: 1) -> None:
        self._client_id = client_id
        self._stub = stub
        self._dram = dram
        self._ssd = ssd
        self._metrics = metrics
        self._wait_s = wait_s
        self._partitions = partitions
        self._wakes: list[threading.Event] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                           thread_name_prefix="kvpool-tier-io")

    def start(self) -> None:
        self._ensure_loops()

    def _ensure_loops(self) -> None:
        """A fetching thread for each partition the master has now."""
        with self._lock:
            while not self._stopping and len(self._threads) < max(1, self._partitions()):
                partition = len(self._threads)
                self._wakes.append(threading.Event())
                thread = threading.Thread(target=self._main, args=(partition,), daemon=True,
                                          name=f"kvpool-tier-{self._client_id}-{partition}")
                self._threads.append(thread)
                thread.start()

    def poke(self, waiting: int = 1) -> None:
        """Copies wait at the master (a heartbeat said so)."""
        if waiting:
            self._ensure_loops()
            for wake in list(self._wakes):
                wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop fetching; wait for the copies in flight (idempotent). A call waiting at the
        master is answered at once by a call that fetches nothing."""
        with self._lock:
            self._stopping = True
            threads = list(self._threads)
        for wake in self._wakes:
            wake.set()
        if any(thread.is_alive() for thread in threads):
            rpc = self._stub()
            try:
                for partition, thread in enumerate(threads):
                    if thread.is_alive():
                        rpc.copy_tasks(self._client_id, [], 0,  # type: ignore[attr-defined]
                                       partition=partition)
            except KVPoolError as exc:
                logger.debug("ending the copier's wait failed: %s", exc)
            finally:
                rpc.close()  # type: ignore[attr-defined]
            for thread in threads:
                thread.join(timeout_s)
        self._pool.shutdown(wait=True)

    def _main(self, partition: int) -> None:
        rpc = self._stub()
        wake = self._wakes[partition]
        done: list[tuple[int, Status]] = []
        try:
            while not self._stopping:
                asked_s = time.monotonic()
                try:
                    tasks = rpc.copy_tasks(self._client_id, done,  # type: ignore[attr-defined]
                                           MAX_TASKS_PER_CALL, self._wait_s,
                                           partition=partition)
                except KVPoolError as exc:
                    logger.debug("CopyTasks failed: %s", exc)
                    done = []
                    wake.wait(RETRY_AFTER_S)
                    wake.clear()
                    continue
                done = []
                if tasks:
                    received_s = time.monotonic()
                    results = list(self._pool.map(self._copy, tasks,
                                                  [received_s] * len(tasks)))
                    done = [(t.task_id, s) for t, (s, _) in zip(tasks, results, strict=True)]
                    self._count(tasks, results)
                    continue
                left_s = self._wait_s - (time.monotonic() - asked_s)
                if left_s > self._wait_s / 2:  # answered at once: a master that does not wait
                    wake.wait(left_s)
                wake.clear()
            if done:  # copies not made (stopping): their targets are freed at once
                rpc.copy_tasks(self._client_id, done, 0,  # type: ignore[attr-defined]
                               partition=partition)
        except KVPoolError as exc:
            logger.debug("reporting the last tier copies failed: %s", exc)
        except Exception:  # a bug must stop the copies, never the client
            logger.exception("tier copier failed; no more tier copies in this client")
        finally:
            close = getattr(rpc, "close", None)
            if close is not None:
                close()

    def _count(self, tasks: list[CopyTask], results: list[tuple[Status, float]]) -> None:
        """Metrics, on the copier's thread (one writer per number)."""
        for task, (status, seconds) in zip(tasks, results, strict=True):
            kind = "promote" if task.source.segment_id in self._ssd else "demote"
            self._metrics.count_failures(kind, [int(status)])
            if status == Status.OK:
                self._metrics.observe_transfer("ssd", kind, task.source.length, seconds)

    def _copy(self, task: CopyTask, received_s: float) -> tuple[Status, float]:
        """(how the copy went, the seconds it took)."""
        if time.monotonic() > received_s + task.start_within_s or self._stopping:
            return Status.TIMEOUT, 0.0
        started = time.perf_counter()
        source, target = task.source, task.target
        promote = source.segment_id in self._ssd
        kind = "promote" if promote else "demote"
        try:
            if promote:
                view = self._dram[target.segment_id].buffer[
                    target.offset:target.offset + target.length]
                self._ssd[source.segment_id].read_into(source.offset, source.length, [view])
            else:
                view = self._dram[source.segment_id].buffer[
                    source.offset:source.offset + source.length]
            if task.checksum and checksum([view]) != task.checksum:
                # a demotion's source evicted and reused meanwhile (the master would refuse
                # the commit anyway); a promotion's: the file does not hold what was written
                (logger.warning if promote else logger.debug)(
                    "%s of %r: the bytes do not match the object's checksum", kind, task.key)
                status = Status.CHECKSUM_MISMATCH
            else:
                if not promote:
                    self._ssd[target.segment_id].write(target.offset, view)
                status = Status.OK
        except KeyError:
            status = Status.SEGMENT_NOT_FOUND  # not a segment of this client (any more)
        except KVPoolError as exc:
            logger.warning("%s of %r failed: %s", kind, task.key, exc)
            status = exc.status
        return status, time.perf_counter() - started

"""What both drivers of one client share, and every step of theirs that does no waiting.

Rules of this file:
- Transport per placement: shared memory when the segment is on this host (unless the config
  forces ``tcp``) and the regions are host memory; else the transfer engine when this client
  has one and the segment advertises one; else TCP (refused when the config forces ``shm``).
  Regions known only by address (``AddressRange``, e.g. device memory) go through the engine
  or fail with INVALID_ARGUMENT: no other transport reaches them. An SSD segment is read from
  its file when it is on this host and this process may open it (``transfer.files``), else
  through its owner's data server (TCP), never through shared memory or the engine.
- A transfer failing with SEGMENT_NOT_FOUND, TRANSFER_FAILED or PERMISSION_DENIED (a refused
  ownership proof, which an owner that re-registered under a new key has replaced) drops what
  this client knows of the segment: the next use asks the master again.
- Caller-moved bytes (``fill`` / ``consume``) are a copy strategy of the same plans: on this
  host the view is the placement's own bytes in the mapped segment (kept mapped while the
  caller holds it); for another host it is a host buffer, sent after ``fill`` or read before
  ``consume``. The caller is done with every view when ``done()`` returns (or, without
  ``done``, when each ``fill`` / ``consume`` returns). With checksums on, a write's checksum is
  taken from the bytes as they landed, and a read is checked before ``consume`` sees them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvpool_client.core.put_plan import WRITE_MARGIN_S, PutPlan, WriteJob, WriteWindow
from kvpool_client.core.read_plan import ReadItem, ReadPlan
from kvpool_client.core.regions import Regions, by_address, checksum
from kvpool_client.metrics import ClientMetrics
from kvpool_client.transfer.engine import EngineTransport
from kvpool_client.transfer.files import FileTransport
from kvpool_client.transfer.shm import ShmTransport
from kvpool_wire.capability import MasterClock
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import SegmentInfo, Tier

logger = logging.getLogger(__name__)

_FORGET_SEGMENT_ON = frozenset({Status.SEGMENT_NOT_FOUND, Status.TRANSFER_FAILED,
                                Status.PERMISSION_DENIED})

#: fill(index, view): write the whole object ``index`` into ``view``; consume(index, view):
#: take the whole object ``index`` from ``view``. Both are done with the view when they return.
Filler = Callable[[int, memoryview], None]
Consumer = Callable[[int, memoryview], None]
#: done(): called once every fill / consume of a call has run and before the writes are
#: committed / the reads judged; fill and consume may leave their copies in flight until it
#: returns (e.g. queue asynchronous device copies, then synchronize once).
Done = Callable[[], None]


class LivenessView(Protocol):
    """What the drivers read from liveness (see liveness.Liveness)."""

    @property
    def epoch(self) -> int: ...

    def is_alive(self, now: float | None = None) -> bool: ...


class ClockView(Protocol):
    """Where the master's capability clock is known (rpc.MasterSession)."""

    clock: MasterClock


class Parts:
    """One client's shared data-path state and no-wait steps; see the module docstring."""

    def __init__(self, *, client_id: str, local_host_id: str, transport: str,
                 shm: ShmTransport, checksum_max_bytes: int, metrics: ClientMetrics,
                 liveness: LivenessView, session: ClockView,
                 engine: EngineTransport | None = None,
                 files: FileTransport | None = None) -> None:
        self.client_id = client_id
        self.local_host_id = local_host_id
        self.force_tcp = transport == "tcp"
        self.shm_only = transport == "shm"
        self.shm = shm
        # objects up to this size get a checksum at put; reads check any committed one
        # (0: "checksum": false, neither)
        self.checksum_max_bytes = checksum_max_bytes
        self.metrics = metrics
        self.liveness = liveness
        self.session = session
        self.engine = engine
        self.files = files if files is not None else FileTransport({}, local_host_id)
        self._segment_id_to_info: dict[str, SegmentInfo] = {}

    # -- segment directory ------------------------------------------------------------------------

    def remember(self, segments: Iterable[SegmentInfo]) -> None:
        """Cache descriptors known without asking the master (this client's own segments)."""
        for info in segments:
            self._segment_id_to_info[info.segment_id] = info

    def missing(self, segment_ids: Iterable[str]) -> list[str]:
        """The segments whose descriptor must be asked of the master."""
        known = self._segment_id_to_info
        return [s for s in set(segment_ids) if s not in known]

    def learn(self, segment_ids: Sequence[str], infos: Sequence[SegmentInfo | None]
              ) -> dict[str, SegmentInfo]:
        """Cache what ``GetSegments`` answered; return every known descriptor."""
        known = self._segment_id_to_info
        for segment_id, info in zip(segment_ids, infos, strict=True):
            if info is not None:
                known[segment_id] = info
        return known

    def forget(self, segment_id: str) -> None:
        """Drop a cached descriptor (and mapping): the next use asks the master again."""
        self._segment_id_to_info.pop(segment_id, None)
        self.shm.forget(segment_id)
        self.files.forget(segment_id)

    def prefers(self, info: SegmentInfo) -> bool:
        """True when ``info`` is reached through shared memory from here."""
        return not self.force_tcp and bool(info.shm_name) and info.host_id == self.local_host_id

    # -- transfers --------------------------------------------------------------------------------

    def route(self, items: Sequence[ReadItem]
              ) -> tuple[list[Status], list[tuple[str, list[int]]]]:
        """(statuses so far, [(transport name, indices)] of the non-empty parts: "shm", then
        "file", "engine", then "tcp")."""
        statuses = [Status.OK] * len(items)
        shm_part: list[int] = []
        file_part: list[int] = []
        engine_part: list[int] = []
        tcp_part: list[int] = []
        engine = self.engine is not None
        for index, (info, _, regions) in enumerate(items):
            if info.tier == Tier.SSD:
                if not self.force_tcp and self.files.reaches(info):
                    file_part.append(index)
                elif self.shm_only or by_address(regions):
                    statuses[index] = Status.TRANSFER_FAILED
                else:
                    tcp_part.append(index)
                continue
            # without an engine, shared memory and TCP refuse such regions themselves
            addressed = engine and by_address(regions)
            if not addressed and self.prefers(info):
                shm_part.append(index)
            elif engine and info.engine_endpoint:
                engine_part.append(index)
            elif addressed:
                statuses[index] = Status.INVALID_ARGUMENT  # only an engine reaches them
                logger.warning("segment %s has no transfer engine (or this client has none): "
                               "device memory cannot reach it", info.segment_id)
            elif self.shm_only:
                statuses[index] = Status.TRANSFER_FAILED  # transport "shm" forbids tcp
            else:
                tcp_part.append(index)
        if not engine_part and not tcp_part and not file_part:  # the common case: one host
            return statuses, [("shm", shm_part)] if shm_part else []
        return statuses, [(name, part) for name, part in (
            ("shm", shm_part), ("file", file_part), ("engine", engine_part),
            ("tcp", tcp_part)) if part]

    def merge(self, items: Sequence[ReadItem], statuses: list[Status], part: list[int],
              part_statuses: Sequence[Status]) -> None:
        """Put a part's statuses in place, forgetting segments that failed."""
        for index, status in zip(part, part_statuses, strict=True):
            statuses[index] = status
            if status in _FORGET_SEGMENT_ON:
                self.forget(items[index][0].segment_id)

    def observe(self, name: str, writing: bool, items: Sequence[ReadItem],
                statuses: Sequence[Status], started_s: float) -> None:
        """Count a transfer part in the metrics."""
        num_bytes = sum(item[1].length for item, status in zip(items, statuses, strict=True)
                        if status == Status.OK)
        self.metrics.observe_transfer(name, "write" if writing else "read", num_bytes,
                                      time.perf_counter() - started_s)

    # -- plans ------------------------------------------------------------------------------------

    def put_plan(self, keys: list[bytes], regions: Sequence[Regions] | None,
                 sizes: list[int]) -> PutPlan:
        """The plan of a write (checksums of ``regions`` taken now; caller-moved writes, with
        ``regions`` None, take theirs after the fill)."""
        limit = self.checksum_max_bytes
        if not limit:
            return PutPlan(keys, sizes, None)
        if regions is None:
            return PutPlan(keys, sizes, [0] * len(keys))
        return PutPlan(keys, sizes, [checksum(r) if size <= limit and not by_address(r) else 0
                                     for r, size in zip(regions, sizes, strict=True)])

    def read_plan(self, keys: Sequence[bytes]) -> ReadPlan:
        """The plan of a read."""
        return ReadPlan(keys, bool(self.checksum_max_bytes))

    @property
    def epoch(self) -> int:
        """This client's registration epoch (it changes when it re-registers)."""
        return self.liveness.epoch

    def window(self, granted_epoch: int) -> WriteWindow:
        """Whether placements granted in ``granted_epoch`` may be written now."""
        ahead_s = time.monotonic() + WRITE_MARGIN_S
        return WriteWindow.at(granted_epoch=granted_epoch, epoch=self.liveness.epoch,
                              alive=self.liveness.is_alive(ahead_s),
                              clock_ms=self.session.clock.now_ms(ahead_s))

    # -- the caller-moved strategy ----------------------------------------------------------------

    def fill(self, plan: PutPlan, jobs: Sequence[WriteJob], fill: Filler, done: Done | None,
             borrowed: contextlib.ExitStack) -> list[tuple[int, ReadItem]]:
        """Let ``fill`` write every job (same-host placements in place, mapped until
        ``borrowed`` closes); return (key index, item) of the host buffers still to send. A
        key whose fill raised fails with TRANSFER_FAILED, every filled key when ``done``
        raised; checksums are taken over the bytes as they landed."""
        remote: list[tuple[int, ReadItem]] = []
        filled: dict[int, memoryview] = {}  # key index -> its first placement's bytes
        for _, index, info, placement in jobs:
            if plan.statuses[index] != Status.OK:
                continue
            try:
                if self.prefers(info):
                    view = borrowed.enter_context(self.shm.borrow(info, placement))
                    fill(index, view)
                else:  # another host: fill a host buffer, send it once done
                    view = memoryview(bytearray(placement.length))
                    fill(index, view)
                    remote.append((index, (info, placement, [view])))
                filled.setdefault(index, view)
            except KVPoolError as exc:
                plan.statuses[index] = exc.status
            except Exception as exc:
                logger.warning("filling %r failed: %s", plan.keys[index], exc)
                plan.statuses[index] = Status.TRANSFER_FAILED
        if done is not None and jobs:
            try:
                done()
            except Exception as exc:
                logger.warning("finishing the fills of %d keys failed: %s", len(plan.keys), exc)
                for index in filled:
                    plan.statuses[index] = Status.TRANSFER_FAILED
        if plan.checksums is not None:  # over the bytes as they landed, while still mapped
            for index, view in filled.items():
                if plan.statuses[index] == Status.OK and len(view) <= self.checksum_max_bytes:
                    plan.checksums[index] = checksum([view])
        return [(index, item) for index, item in remote if plan.statuses[index] == Status.OK]

    @staticmethod
    def sent(plan: PutPlan, remote: Sequence[tuple[int, ReadItem]],
             statuses: Sequence[Status]) -> None:
        """How sending the filled host buffers of ``remote`` went."""
        for (index, _), status in zip(remote, statuses, strict=True):
            if status != Status.OK:
                plan.statuses[index] = status

    @staticmethod
    def received(plan: ReadPlan, views: dict[int, memoryview],
                 remote: Sequence[tuple[int, ReadItem]], statuses: Sequence[Status]) -> None:
        """How reading ``remote`` replicas into host buffers went (failed ones lose their
        view: ``consume`` never sees them)."""
        for (index, _), status in zip(remote, statuses, strict=True):
            if status != Status.OK:
                plan.results[index] = int(status)
                del views[index]

    def borrow_replicas(self, plan: ReadPlan, infos: dict[str, SegmentInfo],
                        borrowed: contextlib.ExitStack
                        ) -> tuple[dict[int, memoryview], list[tuple[int, ReadItem]]]:
        """Per granted key the view ``consume`` will get: a same-host replica's own bytes
        (mapped until ``borrowed`` closes) or a host buffer still to be read, listed as
        (key index, item)."""
        views: dict[int, memoryview] = {}
        remote: list[tuple[int, ReadItem]] = []
        for index, reply in enumerate(plan.replies):
            plan.results[index] = int(reply.status) if reply.status != Status.OK else \
                int(Status.SEGMENT_NOT_FOUND)
            for info, placement in plan.candidates(index, infos, self.prefers):
                if not self.prefers(info):  # another host: read into a host buffer first
                    views[index] = memoryview(bytearray(placement.length))
                    remote.append((index, (info, placement, [views[index]])))
                    break
                try:
                    views[index] = borrowed.enter_context(self.shm.borrow(info, placement))
                    break
                except KVPoolError as exc:  # try the next replica
                    plan.results[index] = int(exc.status)
                    if exc.status in (Status.SEGMENT_NOT_FOUND, Status.TRANSFER_FAILED):
                        self.forget(info.segment_id)
        return views, remote

    def consume(self, plan: ReadPlan, views: dict[int, memoryview], consume: Consumer,
                done: Done | None) -> None:
        """Hand every view to ``consume`` (checked first), call ``done``, then judge each key
        by the lease at that moment: what was taken after it ran out reads LEASE_EXPIRED."""
        taken: list[int] = []
        attempted = False  # a consume ran: done() must end its copies before the views go
        for index, view in views.items():
            if not plan.checksum_matches(index, [view]):
                plan.results[index] = int(Status.CHECKSUM_MISMATCH)
                continue
            attempted = True
            try:
                consume(index, view)
            except Exception as exc:
                logger.warning("consuming %r failed: %s", plan.keys[index], exc)
                plan.results[index] = int(Status.TRANSFER_FAILED)
                continue
            taken.append(index)
        if attempted and done is not None:
            try:
                done()
            except Exception as exc:
                logger.warning("finishing the reads of %d keys failed: %s", len(taken), exc)
                for index in taken:
                    plan.results[index] = int(Status.TRANSFER_FAILED)
                taken = []
        now_s = time.monotonic()  # the bytes may have been replaced once the lease ran out
        for index in taken:
            plan.results[index] = plan.judge(index, None, now_s)

"""A batch read, step by step, with no I/O.

    plan = ReadPlan(keys, check_checksums)
    plan.granted(get_replicas_results, sent_s, lease_ttl_s)
    plan.choose(infos, dst_for, prefers)       # per key its destination and candidate replicas
    while (items := plan.attempt()):
        ... the driver copies each item (placement -> destination) ...
        plan.attempted(statuses, now_s)       # failures move on to the next replica
    plan.results                               # per key its size, or a negative Status

Rules: a key is read from one replica, same-host ones first, the next one after a failure
while the lease holds. The bytes count as read only when the lease had not run out when the
copy finished (``deadline_s``, counted from when ``GetReplicas`` was sent, with a margin) and
the checksum matches where one was committed; otherwise the key reads LEASE_EXPIRED or
CHECKSUM_MISMATCH: the bytes may have been overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

from kvpool_client.core.put_plan import check_answers
from kvpool_client.core.regions import Regions, by_address, checksum
from kvpool_wire.status import Status
from kvpool_wire.types import Placement, ReadResult, SegmentInfo

#: Reads must finish this much before the lease runs out (clock-rate differences, scheduling).
LEASE_MARGIN_RATIO = 0.02
LEASE_MARGIN_MIN_S = 0.001

#: dst_for(key index, size_bytes): where key ``index``'s bytes go, or a Status to fail it
#: (e.g. BUFFER_OVERFLOW).
DstFor = Callable[[int, int], "Regions | Status"]
#: (segment, placement, destination) of one copy.
ReadItem = tuple[SegmentInfo, Placement, Regions]
#: Where one object lies: its size and each replica with its segment's descriptor (None where
#: the segment is not known); None for a key that is not READY.
KeyReplicas: TypeAlias = tuple[int, list[tuple[Placement, SegmentInfo | None]]] | None


def lease_deadline(sent_s: float, lease_ttl_s: float) -> float:
    """The monotonic time by which a read granted a lease of ``lease_ttl_s``, asked for at
    ``sent_s``, must have finished with the bytes."""
    return sent_s + lease_ttl_s - max(lease_ttl_s * LEASE_MARGIN_RATIO, LEASE_MARGIN_MIN_S)


class ReadPlan:
    """One batch read; see the module docstring."""

    __slots__ = ("keys", "results", "replies", "deadline_s", "lease_ids", "_check_checksums",
                 "_jobs", "_attempt")

    def __init__(self, keys: Sequence[bytes], check_checksums: bool) -> None:
        self.keys = keys
        #: per key the bytes read, or a negative Status
        self.results = [0] * len(keys)
        self.replies: list[ReadResult[Placement]] = []
        self.deadline_s = 0.0
        self.lease_ids: tuple[int, ...] = ()
        self._check_checksums = check_checksums
        self._jobs: list[tuple[int, list[ReadItem]]] = []  # (key index, candidates in order)
        self._attempt = 0

    def granted(self, replies: list[ReadResult[Placement]], sent_s: float, lease_ttl_s: float,
                lease_ids: tuple[int, ...] = ()) -> None:
        """Take the ``GetReplicas`` answer (``sent_s``: when it was asked for; ``lease_ids``:
        the leases to end, none when they cannot be ended). Raises INTERNAL_ERROR for a short
        answer."""
        check_answers("GetReplicas", replies, self.keys)
        self.replies = replies
        self.deadline_s = lease_deadline(sent_s, lease_ttl_s)
        self.lease_ids = lease_ids

    def lease(self) -> tuple[tuple[int, ...], list[bytes]]:
        """(lease ids, the keys they cover): what to end once every copy out of them is done
        (never before: the master may reuse their bytes as soon as it learns of the end)."""
        keys = [key for key, reply in zip(self.keys, self.replies, strict=True)
                if reply.status == Status.OK]
        return self.lease_ids, keys

    def replicas(self, infos: Mapping[str, SegmentInfo]) -> list[KeyReplicas]:
        """Per key (its size, each replica with its segment's descriptor, None where the
        segment is not known), or None when the key was not granted: where the objects lie,
        with nothing read."""
        return [(reply.size_bytes, [(p, infos.get(p.segment_id)) for p in reply.placements])
                if reply.status == Status.OK else None for reply in self.replies]

    @property
    def segment_ids(self) -> set[str]:
        """The segments the granted replicas are on."""
        return {p.segment_id for r in self.replies if r.status == Status.OK
                for p in r.placements}

    def candidates(self, index: int, infos: Mapping[str, SegmentInfo],
                   prefers: Callable[[SegmentInfo], bool]) -> list[tuple[SegmentInfo, Placement]]:
        """Key ``index``'s replicas whose segment is known, preferred ones first (none when
        the key was not granted)."""
        reply = self.replies[index]
        if reply.status != Status.OK:
            return []
        # (one lookup each: another thread may forget a segment between two)
        found = [(info, p) for p in reply.placements
                 if (info := infos.get(p.segment_id)) is not None]
        if len(found) > 1:
            found.sort(key=lambda pair: not prefers(pair[0]))
        return found

    def choose(self, infos: Mapping[str, SegmentInfo], dst_for: DstFor,
               prefers: Callable[[SegmentInfo], bool]) -> None:
        """Give every granted key its destination and candidate replicas; the others get
        their status."""
        for index, reply in enumerate(self.replies):
            if reply.status != Status.OK:
                self.results[index] = int(reply.status)
                continue
            dst = dst_for(index, reply.size_bytes)
            if isinstance(dst, Status):
                self.results[index] = int(dst)
                continue
            found = self.candidates(index, infos, prefers)
            if not found:
                self.results[index] = int(Status.SEGMENT_NOT_FOUND)
                continue
            self._jobs.append((index, [(info, p, dst) for info, p in found]))

    def attempt(self) -> list[ReadItem]:
        """The copies of the next attempt (empty once every key is judged)."""
        attempt = self._attempt
        return [candidates[attempt] for _, candidates in self._jobs]

    def attempted(self, statuses: Sequence[Status], now_s: float) -> None:
        """How the attempt's copies went, at ``now_s`` (monotonic)."""
        retry: list[tuple[int, list[ReadItem]]] = []
        attempt = self._attempt
        for (index, candidates), status in zip(self._jobs, statuses, strict=True):
            if status == Status.OK:
                self.results[index] = self.judge(index, candidates[attempt][2], now_s)
            elif attempt + 1 < len(candidates) and now_s < self.deadline_s:
                retry.append((index, candidates))
            else:
                self.results[index] = int(status)
        self._jobs = retry
        self._attempt = attempt + 1

    def judge(self, index: int, dst: Sequence[memoryview] | None, now_s: float) -> int:
        """Key ``index``'s result once its bytes are in ``dst`` at ``now_s``: its size, or
        LEASE_EXPIRED / CHECKSUM_MISMATCH (``dst`` None: the checksum was checked already)."""
        reply = self.replies[index]
        if now_s > self.deadline_s:
            # The lease ran out while the bytes moved: they may have been overwritten.
            return int(Status.LEASE_EXPIRED)
        if dst is not None and not self.checksum_matches(index, dst):
            return int(Status.CHECKSUM_MISMATCH)
        return reply.size_bytes

    def checksum_matches(self, index: int, dst: Sequence[memoryview]) -> bool:
        """True unless a checksum was committed for key ``index`` and ``dst`` differs (bytes
        known by address only cannot be checked here: they pass)."""
        expected = self.replies[index].checksum
        return not (expected and self._check_checksums and not by_address(dst)
                    and checksum(dst) != expected)

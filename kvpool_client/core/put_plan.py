"""A batch write, step by step, with no I/O: the driver sends what the plan asks for and hands
back what came of it.

    plan = PutPlan(keys, sizes, checksums)
    plan.started(put_start_answers)                  # OK keys get placements to write
    jobs = plan.writable(infos, window)              # placements that may be written now
    ... the driver copies the bytes of each job (its transport, or the caller's fill) ...
    plan.copied(jobs, statuses)
    revoke, commit = plan.revoke_keys(), plan.commit_indices()
    ... the driver sends PutRevoke(revoke) and PutEnd(commit) ...
    plan.committed(commit, put_end_statuses)
    plan.statuses                                     # one Status per key

Rules: ``ALREADY_EXISTS`` is success (nothing to write). A key is committed only when every one
of its placements was written; otherwise it is revoked. Nothing is written once this client
re-registered since ``PutStart`` (the epoch changed), once its liveness lapsed, or once the
placement's write capability expired (``WriteWindow``): the master may already have given those
bytes to someone else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, SegmentInfo

#: Writes stop this long before liveness or the write capability runs out.
WRITE_MARGIN_S = 0.05

_OK = (Status.OK, Status.ALREADY_EXISTS)


def check_answers(call: str, answers: Sequence[object], keys: Sequence[object]) -> None:
    """A batch answer must have one item per key: a short one would leave keys unanswered,
    and an unanswered key must never pass for a success. Raises INTERNAL_ERROR."""
    if len(answers) != len(keys):
        raise KVPoolError(Status.INTERNAL_ERROR,
                          f"{call} answered {len(answers)} items for {len(keys)} keys")


def space_refused(answers: Sequence[tuple[Status, Sequence[Placement]]]) -> list[int]:
    """The indices of the keys ``PutStart`` refused for want of space."""
    return [index for index, (status, _) in enumerate(answers) if status == Status.NO_SPACE]


def granted_any(answers: Sequence[tuple[Status, Sequence[Placement]]]) -> bool:
    """Whether ``PutStart`` granted placements to any key."""
    return any(status == Status.OK for status, _ in answers)


def answered_again(answers: Sequence[tuple[Status, Sequence[Placement]]], indices: Sequence[int],
                   again: Sequence[tuple[Status, Sequence[Placement]]],
                   ) -> list[tuple[Status, Sequence[Placement]]]:
    """``answers`` with the answer of each key of ``indices`` replaced by its answer in
    ``again`` (a second ``PutStart`` of those keys). Raises INTERNAL_ERROR for a short answer."""
    check_answers("PutStart", again, indices)
    merged = list(answers)
    for index, answer in zip(indices, again, strict=True):
        merged[index] = answer
    return merged


@dataclass(frozen=True, slots=True)
class WriteWindow:
    """Whether placements granted in one epoch may be written, judged at one instant.

    ``status``: OK, UNKNOWN_CLIENT (re-registered since the grant) or TIMEOUT (liveness
    lapsed, ``WRITE_MARGIN_S`` ahead); ``clock_ms``: an upper bound of the master's capability
    clock at that instant (margin included), against which capabilities are checked.
    """

    status: Status
    clock_ms: float

    @classmethod
    def at(cls, *, granted_epoch: int, epoch: int, alive: bool, clock_ms: float) -> WriteWindow:
        """The window of placements granted in ``granted_epoch`` when the client is in
        ``epoch`` and ``alive`` (both judged ``WRITE_MARGIN_S`` ahead by the caller)."""
        if epoch != granted_epoch:
            return cls(Status.UNKNOWN_CLIENT, clock_ms)
        return cls(Status.OK if alive else Status.TIMEOUT, clock_ms)

    def allows(self, placement: Placement) -> Status:
        """OK while ``placement`` may still be written."""
        if self.status != Status.OK:
            return self.status
        if placement.capability_expiry_ms and placement.capability_expiry_ms < self.clock_ms:
            return Status.TIMEOUT
        return Status.OK


#: (job number, key index, segment, placement) of one placement to write.
WriteJob = tuple[int, int, SegmentInfo, Placement]


class PutPlan:
    """One batch write; see the module docstring."""

    __slots__ = ("keys", "sizes", "checksums", "statuses", "placements")

    def __init__(self, keys: list[bytes], sizes: list[int], checksums: list[int] | None) -> None:
        self.keys = keys
        self.sizes = sizes
        #: per key, the checksum to commit (0: none); None: no checksums at all
        self.checksums = checksums
        self.statuses = [Status.OK] * len(keys)
        #: (key index, placement) of every placement the master granted
        self.placements: list[tuple[int, Placement]] = []

    def started(self, answers: Sequence[tuple[Status, Sequence[Placement]]]) -> None:
        """Take the ``PutStart`` answers. Raises INTERNAL_ERROR for a short answer."""
        check_answers("PutStart", answers, self.keys)
        for index, (status, placements) in enumerate(answers):
            if status == Status.OK and placements:
                self.placements.extend((index, placement) for placement in placements)
            elif status != Status.ALREADY_EXISTS:
                self.statuses[index] = status if status != Status.OK else Status.INTERNAL_ERROR

    @property
    def segment_ids(self) -> set[str]:
        """The segments the granted placements are on."""
        return {placement.segment_id for _, placement in self.placements}

    def writable(self, infos: Mapping[str, SegmentInfo], window: WriteWindow) -> list[WriteJob]:
        """The placements that may be written now; the others fail their key
        (SEGMENT_NOT_FOUND, or why ``window`` refuses them)."""
        jobs: list[WriteJob] = []
        statuses = self.statuses
        for number, (index, placement) in enumerate(self.placements):
            if statuses[index] != Status.OK:
                continue
            info = infos.get(placement.segment_id)
            status = Status.SEGMENT_NOT_FOUND if info is None else window.allows(placement)
            if status == Status.OK:
                assert info is not None
                jobs.append((number, index, info, placement))
            else:
                statuses[index] = status
        return jobs

    def copied(self, jobs: Sequence[WriteJob], statuses: Sequence[Status]) -> None:
        """How each job's copy went (a key fails with its first failed placement)."""
        for (_, index, _, _), status in zip(jobs, statuses, strict=True):
            if status != Status.OK and self.statuses[index] == Status.OK:
                self.statuses[index] = status

    def revoke_keys(self) -> list[bytes]:
        """The keys granted placements whose write failed: they must be revoked."""
        failed = sorted({i for i, _ in self.placements if self.statuses[i] != Status.OK})
        return [self.keys[i] for i in failed]

    def commit_indices(self) -> list[int]:
        """The keys whose every placement was written: they may be committed."""
        return sorted({i for i, _ in self.placements if self.statuses[i] == Status.OK})

    def commit_checksums(self, indices: Sequence[int]) -> list[int] | None:
        """The checksums to commit with the keys ``indices`` (None: none)."""
        checksums = self.checksums
        return [checksums[i] for i in indices] if checksums is not None else None

    def committed(self, indices: Sequence[int], answers: Sequence[Status]) -> None:
        """Take the ``PutEnd`` answers of the keys ``indices`` (a short answer fails them)."""
        if len(answers) != len(indices):
            answers = [Status.INTERNAL_ERROR] * len(indices)
        for index, status in zip(indices, answers, strict=True):
            if status not in _OK:
                self.statuses[index] = status

    def failed(self, indices: Sequence[int], status: Status) -> None:
        """Fail the keys ``indices`` with ``status`` (e.g. their commit could not be sent)."""
        for index in indices:
            self.statuses[index] = status

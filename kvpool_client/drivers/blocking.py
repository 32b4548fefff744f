"""The blocking driver: runs the core's plans on the caller's thread, with no event loop.

Master calls go through the blocking stub (``rpc.blocking``), shared-memory copies are made on
the calling thread (the copy workers help with large batches), TCP transfers use blocking
sockets (``transfer.tcp_blocking``). Any thread may call at the same time. The steps and their
rules are those of the asyncio driver (``drivers.aio``), less pipelining: here a batch never
waits on the master while it could copy, so it is not cut into sub-batches.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from kvpool_client.core.put_plan import PutPlan, answered_again, granted_any, space_refused
from kvpool_client.core.read_plan import DstFor, KeyReplicas, ReadItem, ReadPlan
from kvpool_client.core.regions import Regions
from kvpool_client.drivers.parts import Consumer, Done, Filler, Parts
from kvpool_client.rpc import BlockingMasterRpc, Registration
from kvpool_client.transfer.tcp_blocking import BlockingTcpTransport
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import PutOptions, SegmentInfo

logger = logging.getLogger(__name__)


class Membership(Protocol):
    """What the driver reads of the client's registration (see liveness.Liveness)."""

    @property
    def epoch(self) -> int: ...

    @property
    def registration(self) -> Registration: ...

    def request_reregister(self) -> concurrent.futures.Future[int]: ...

    def remounting(self) -> concurrent.futures.Future[int] | None: ...


class BlockingDataPath:
    """Moves objects between caller regions and the pool on the calling thread."""

    def __init__(self, parts: Parts, rpc: BlockingMasterRpc, tcp: BlockingTcpTransport, *,
                 membership: Membership, host_id: str, hostname: str,
                 reregister_timeout_s: float) -> None:
        self.parts = parts
        self.rpc = rpc
        self.tcp = tcp
        self._membership = membership
        self._host_id = host_id
        self._hostname = hostname
        self._reregister_timeout_s = reregister_timeout_s
        self._epoch = membership.epoch

    def refresh(self) -> None:
        """Register the stub's session again (idempotent for a known client, proving its
        token), so that the stub learns the master's lean endpoints; a different key means
        the master forgot this client once more: liveness re-registers."""
        try:
            registration = self.rpc.register_client(self.parts.client_id, self._host_id,
                                                    self._hostname)
        except KVPoolError as exc:
            logger.debug("refreshing the blocking master stub failed: %s", exc)
            return
        if registration.capability_key != self._membership.registration.capability_key:
            self._membership.request_reregister()

    def follow_epoch(self) -> None:
        """After a re-registration, refresh once (see ``refresh``)."""
        epoch = self._membership.epoch
        if epoch != self._epoch:
            self._epoch = epoch
            self.refresh()

    def close(self) -> None:
        """Close the master stub and the TCP connections (idempotent)."""
        self.rpc.close()
        self.tcp.close()

    def resolve(self, segment_ids: set[str]) -> dict[str, SegmentInfo]:
        """Every known descriptor, after asking the master for those of ``segment_ids`` not
        known yet."""
        parts = self.parts
        missing = parts.missing(segment_ids)
        return parts.learn(missing, self.rpc.get_segments(missing) if missing else [])

    def transfer(self, items: Sequence[ReadItem], *, writing: bool) -> list[Status]:
        """Move every item through its transport (shared memory, the engine, then TCP)."""
        parts = self.parts
        statuses, routes = parts.route(items)
        for name, part in routes:
            chosen = [items[i] for i in part]
            started = time.perf_counter()
            if name == "shm":
                part_statuses = parts.shm.copy_batch(chosen, writing=writing)
            elif name == "file":
                part_statuses = parts.files.write_batch(chosen) if writing else \
                    parts.files.read_batch(chosen)
            elif name == "engine":
                assert parts.engine is not None
                part_statuses = parts.engine.write_batch(chosen) if writing else \
                    parts.engine.read_batch(chosen)
            elif writing:
                part_statuses = self.tcp.write_batch(chosen)
            else:
                part_statuses = self.tcp.read_batch(chosen)
            parts.observe(name, writing, chosen, part_statuses, started)
            parts.merge(items, statuses, part, part_statuses)
        return statuses

    # -- writes -----------------------------------------------------------------------------------

    def write(self, keys: list[bytes], regions: list[Regions], sizes: list[int],
              options: PutOptions) -> list[Status]:
        """Write distinct keys of non-empty regions; one Status per key (ALREADY_EXISTS is OK).
        Raises KVPoolError only when ``PutStart`` failed: then nothing was written."""
        plan = self.parts.put_plan(keys, regions, sizes)
        epoch = self._start(plan, options)
        if plan.placements:
            jobs = plan.writable(self.resolve(plan.segment_ids), self.parts.window(epoch))
            if jobs:
                items = [(info, placement, regions[index]) for _, index, info, placement in jobs]
                plan.copied(jobs, self.transfer(items, writing=True))
            self._settle(plan)
        return plan.statuses

    def write_with(self, keys: list[bytes], sizes: list[int], options: PutOptions,
                   fill: Filler, done: Done | None = None) -> list[Status]:
        """Like ``write``, with ``fill`` moving the bytes (see ``parts``)."""
        plan = self.parts.put_plan(keys, None, sizes)
        epoch = self._start(plan, options)
        if not plan.placements:
            return plan.statuses
        jobs = plan.writable(self.resolve(plan.segment_ids), self.parts.window(epoch))
        with contextlib.ExitStack() as borrowed:
            remote = self.parts.fill(plan, jobs, fill, done, borrowed)
        if remote:
            self.parts.sent(plan, remote,
                            self.transfer([item for _, item in remote], writing=True))
        self._settle(plan)
        return plan.statuses

    def _start(self, plan: PutPlan, options: PutOptions) -> int:
        parts, rpc = self.parts, self.rpc
        epoch = parts.epoch
        answers = rpc.put_start(parts.client_id, plan.keys, plan.sizes, options)
        if answers and all(status == Status.UNKNOWN_CLIENT for status, _ in answers):
            self.wait_reregistered()
            epoch = parts.epoch
            answers = rpc.put_start(parts.client_id, plan.keys, plan.sizes, options)
        refused = space_refused(answers)
        if refused and self._remounted():
            # Asked while this client's segments were being mounted again: ask once more.
            if not granted_any(answers):
                epoch = parts.epoch
            again = rpc.put_start(parts.client_id, [plan.keys[i] for i in refused],
                                  [plan.sizes[i] for i in refused], options)
            answers = answered_again(answers, refused, again)
        plan.started(answers)
        return epoch

    def _remounted(self) -> bool:
        """Wait for a re-registration under way to mount this client's segments again; False
        when none was under way (or it did not end in time)."""
        remount = self._membership.remounting()
        if remount is None:
            return False
        try:
            remount.result(self._reregister_timeout_s)
        except (concurrent.futures.TimeoutError, KVPoolError):
            return False
        return True

    def wait_reregistered(self) -> None:
        """Wait for liveness to re-register this client (a call answered UNKNOWN_CLIENT)."""
        timeout_s = self._reregister_timeout_s
        try:
            self._membership.request_reregister().result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise KVPoolError(Status.UNKNOWN_CLIENT, "the master does not know this client and "
                              f"re-registration did not finish within {timeout_s:g} s") from None

    def _settle(self, plan: PutPlan) -> None:
        client_id = self.parts.client_id
        revoke = plan.revoke_keys()
        if revoke:
            try:
                self.rpc.put_revoke(client_id, revoke)
            except KVPoolError as exc:
                # The master reclaims them after put_start_discard_timeout anyway.
                logger.warning("put_revoke of %d keys failed: %s", len(revoke), exc)
        indices = plan.commit_indices()
        if not indices:
            return
        keys = [plan.keys[i] for i in indices]
        try:
            plan.committed(indices, self.rpc.put_end(client_id, keys,
                                                     plan.commit_checksums(indices)))
        except KVPoolError as exc:
            plan.failed(indices, exc.status)

    # -- reads ------------------------------------------------------------------------------------

    def read(self, keys: Sequence[bytes], dst_for: DstFor) -> list[int]:
        """Read objects into the regions ``dst_for(index, size_bytes)`` returns (or a Status to
        fail that key). Per key the bytes read, or a negative Status. Raises KVPoolError only
        when ``GetReplicas`` failed."""
        plan, infos = self._grant(keys)
        plan.choose(infos, dst_for, self.parts.prefers)
        while items := plan.attempt():
            statuses = self.transfer(items, writing=False)
            plan.attempted(statuses, time.monotonic())
        self.rpc.session.end_lease(*plan.lease())
        return plan.results

    def replicas(self, keys: Sequence[bytes]) -> list[KeyReplicas]:
        """Where each object lies (``ReadPlan.replicas``); the read lease the lookup took is
        given back at once, as nothing is read."""
        plan, infos = self._grant(keys)
        self.rpc.session.end_lease(*plan.lease())
        return plan.replicas(infos)

    def _grant(self, keys: Sequence[bytes]) -> tuple[ReadPlan, dict[str, SegmentInfo]]:
        plan = self.parts.read_plan(keys)
        sent_s = time.monotonic()
        answer = self.rpc.get_replicas(self.parts.client_id, keys)
        plan.granted(answer.results, sent_s, answer.lease_ttl_s, answer.lease_ids)
        needed = plan.segment_ids
        return plan, (self.resolve(needed) if needed else {})

    def read_with(self, keys: Sequence[bytes], consume: Consumer,
                  done: Done | None = None) -> list[int]:
        """Like ``read``, with ``consume`` taking the bytes (see ``parts``)."""
        plan, infos = self._grant(keys)
        with contextlib.ExitStack() as borrowed:  # same-host replicas stay mapped until done
            views, remote = self.parts.borrow_replicas(plan, infos, borrowed)
            if remote:
                self.parts.received(plan, views, remote, self.transfer(
                    [item for _, item in remote], writing=False))
            self.parts.consume(plan, views, consume, done)
        self.rpc.session.end_lease(*plan.lease())
        return plan.results

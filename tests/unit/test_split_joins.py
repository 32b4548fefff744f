"""The answers of a batch sent as several calls, joined (``rpc.joins``): a part that failed
fails its own keys, the batch raises only when every part failed, and a prefix query counts
across parts only up to the first miss."""

from __future__ import annotations

import pytest

from kvpool_client.rpc.joins import joined_exist, joined_lists, joined_prefix, joined_replicas
from kvpool_wire.calls import ReplicasAnswer
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, ReadResult, SegmentId

SPANS = [(0, range(0, 3)), (0, range(3, 6)), (0, range(6, 7))]  # slices of one process
TIMEOUT = KVPoolError(Status.TIMEOUT, "part 2")


def test_a_failed_part_fails_its_own_keys() -> None:
    ok = [Status.OK] * 3
    joined = joined_lists(SPANS, lambda s: s, [ok, TIMEOUT, [Status.NOT_FOUND]])
    assert joined == ok + [Status.TIMEOUT] * 3 + [Status.NOT_FOUND]
    started = joined_lists(SPANS, lambda s: (s, ()), [TIMEOUT, [(Status.OK, ("p",))] * 3,
                                                      [(Status.OK, ("q",))]])
    assert started == [(Status.TIMEOUT, ())] * 3 + [(Status.OK, ("p",))] * 3 + \
        [(Status.OK, ("q",))]


def test_the_batch_raises_when_every_part_failed() -> None:
    first = KVPoolError(Status.RPC_FAILED, "part 1")
    with pytest.raises(KVPoolError) as raised:
        joined_lists(SPANS, lambda s: s, [first, TIMEOUT, TIMEOUT])
    assert raised.value is first
    with pytest.raises(KVPoolError):
        joined_exist(SPANS, [first, TIMEOUT, TIMEOUT])
    with pytest.raises(KVPoolError):
        joined_replicas(SPANS, [first, TIMEOUT, TIMEOUT])


def test_exist_joins_statuses_and_sizes() -> None:
    joined = joined_exist(SPANS, [([Status.OK] * 3, [1, 2, 3]), TIMEOUT,
                                   ([Status.NOT_FOUND], [0])])
    assert joined == ([Status.OK] * 3 + [Status.TIMEOUT] * 3 + [Status.NOT_FOUND],
                      [1, 2, 3, 0, 0, 0, 0])


def test_replicas_join_results_keep_every_lease_and_the_shortest_ttl() -> None:
    def answer(offset: int, n: int, ttl_s: float, lease_id: int) -> ReplicasAnswer:
        return ReplicasAnswer([ReadResult(Status.OK, 10, (Placement(SegmentId("s"), offset + i,
                                                                    10),), 0)
                               for i in range(n)], ttl_s, (lease_id,))
    joined = joined_replicas(SPANS, [answer(0, 3, 5.0, 7), TIMEOUT, answer(6, 1, 4.5, 9)])
    assert [r.status for r in joined.results] == [Status.OK] * 3 + [Status.TIMEOUT] * 3 + \
        [Status.OK]
    assert [r.placements[0].offset for r in joined.results if r.placements] == [0, 1, 2, 6]
    assert joined.lease_ttl_s == 4.5 and joined.lease_ids == (7, 9)


def test_a_prefix_counts_across_parts_up_to_the_first_miss() -> None:
    assert joined_prefix(SPANS, [3, 3, 1]) == 7
    assert joined_prefix(SPANS, [3, 2, 1]) == 5        # a miss in part 2: part 3 not counted
    assert joined_prefix(SPANS, [1, 3, 1]) == 1
    assert joined_prefix(SPANS, [3, TIMEOUT, 1]) == 3  # a failed part ends the count
    with pytest.raises(KVPoolError):
        joined_prefix(SPANS, [TIMEOUT, 3, 1])          # ... and the call when it is the first

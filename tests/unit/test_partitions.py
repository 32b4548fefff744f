"""A partitioned index, in process: each partition's share of a segment, the numbering of
leases and copy tasks, joining a later partition with partition 0's ticket (and nothing
else), the state directory's layout, and a client's routing of a batch and joining of the
answers (README, "Partitions")."""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path
from typing import Any

import pytest

from kvpool_client.rpc.joins import (
    all_ok,
    joined_lists,
    joined_prefix,
    joined_replicas,
    merged_status,
)
from kvpool_client.rpc.session import MasterCalls, MasterSession
from kvpool_master.clock import ServingClock
from kvpool_master.core.allocator import ALIGN_BYTES, Allocator, share
from kvpool_master.core.config import CoreConfig
from kvpool_master.core.master import MasterCore
from kvpool_master.core.tiering import CopyTable
from kvpool_master.partition import (
    PartitionTerms,
    StateLayoutError,
    claim_state_dir,
    state_dir_of,
)
from kvpool_master.rpc.servicer import Servicer
from kvpool_wire import calls
from kvpool_wire.calls import ReplicasAnswer
from kvpool_wire.capability import client_token
from kvpool_wire.partitions import (
    TICKET_TTL_MS,
    PartitionEndpoint,
    partition_of,
    partitions_of,
    stray,
    ticket,
    ticket_number,
)
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, PutOptions, ReadResult, SegmentId, SegmentInfo

MiB = 1 << 20


# -- shares of a segment ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", [64 * MiB, 64 * MiB + 100, 10_000_003, 4096])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_the_shares_of_a_segment_tile_its_aligned_bytes(size: int, count: int) -> None:
    shares = [share(size, (index, count)) for index in range(count)]
    assert shares[0][0] == 0 and shares[-1][1] == size - size % ALIGN_BYTES
    for (_, end), (start, _) in itertools.pairwise(shares):
        assert end == start  # back to back: none overlaps, no byte is left out
    assert all(start % ALIGN_BYTES == 0 and end % ALIGN_BYTES == 0 for start, end in shares)


def test_an_allocator_of_a_share_allocates_and_frees_only_in_it() -> None:
    size = 64 * MiB
    start, end = share(size, (1, 3))
    allocator = Allocator(size, (1, 3))
    assert allocator.size_bytes == end - start and allocator.free_bytes == end - start
    offsets = []
    while (offset := allocator.allocate(MiB)) >= 0:
        offsets.append(offset)
    assert offsets and all(start <= o and o + MiB <= end for o in offsets)
    assert allocator.used_bytes == len(offsets) * MiB <= end - start
    offsets += allocator.allocate_run(ALIGN_BYTES, 4)   # what is left past the whole MiBs
    assert all(start <= o < end for o in offsets)
    with pytest.raises(ValueError):
        allocator.free(0, ALIGN_BYTES)   # partition 0's bytes
    with pytest.raises(ValueError):
        allocator.free(end, ALIGN_BYTES)  # partition 2's
    with pytest.raises(ValueError):
        allocator.free_packed([0 << 48 | ALIGN_BYTES])
    allocator.free(offsets[0], MiB)
    assert allocator.allocate(MiB) == offsets[0]


def test_a_share_rebuilt_from_its_extents_refuses_extents_outside_it() -> None:
    size = 16 * MiB
    start, end = share(size, (1, 2))
    rebuilt = Allocator.from_used(size, [(start, MiB), (end - MiB, MiB)], (1, 2))
    assert rebuilt.used_bytes == 2 * MiB and rebuilt.free_extents() == [(start + MiB,
                                                                          end - start - 2 * MiB)]
    with pytest.raises(ValueError):
        Allocator.from_used(size, [(0, MiB)], (1, 2))
    with pytest.raises(ValueError):
        Allocator.from_used(size, [(end - MiB, MiB)], (0, 2))


def _core(index: int, count: int) -> MasterCore:
    core = MasterCore(CoreConfig(partition_index=index, partition_count=count))
    assert core.register_client(ClientId("c"), "h", b"k" * 32, 0.0)[0] == Status.OK
    assert core.mount_segment(SegmentInfo(SegmentId("s"), ClientId("c"), 8 * MiB), 0.0) \
        == Status.OK
    return core


def test_partitions_place_in_disjoint_shares_and_number_leases_as_their_own() -> None:
    cores = [_core(index, 3) for index in range(3)]
    placed: list[tuple[int, int]] = []
    for index, core in enumerate(cores):
        keys = [b"p%d-%d" % (index, i) for i in range(100)]
        results = core.put_start(ClientId("c"), keys, [4096] * 100, PutOptions(), 1.0)
        assert [status for status, _ in results] == [Status.OK] * 100
        assert core.put_end(ClientId("c"), keys, 1.0) == [Status.OK] * 100
        start, end = share(8 * MiB, (index, 3))
        extents = [p for _, placements in results for p in placements]
        assert all(start <= e.offset and e.offset + e.length <= end for e in extents)
        placed += [(e.offset, e.length) for e in extents]
        for _ in range(3):
            core.get_replicas(keys[:2], 2.0, reader=ClientId("c"))
            assert core.last_lease_id % 3 == index and core.last_lease_id > index
    placed.sort()
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(placed))   # no overlap
    assert core.stats().tier_to_capacity_bytes[0] == 8 * MiB - share(8 * MiB, (2, 3))[0]


def test_copy_task_numbers_name_their_partition() -> None:
    table = CopyTable((2, 5))
    numbers = [next(table._ids) for _ in range(4)]
    assert numbers == [7, 12, 17, 22] and all(n % 5 == 2 for n in numbers)
    assert [next(CopyTable()._ids) for _ in range(1)] == [1]


@pytest.mark.parametrize("index, count", [(0, 0), (2, 2), (-1, 2), (0, 65), (True, 2)])
def test_a_partition_out_of_range_is_refused(index: Any, count: Any) -> None:
    with pytest.raises(ValueError, match="partition"):
        CoreConfig(partition_index=index, partition_count=count)


# -- joining a later partition ---------------------------------------------------------------------

def test_a_key_belongs_to_the_partition_of_its_crc32() -> None:
    # the CRC-32 check value: every language's zlib computes it the same
    assert zlib.crc32(b"123456789") == 0xCBF43926
    assert partition_of(b"123456789", 7) == 0xCBF43926 % 7 == 5
    keys = [b"key-%d" % i for i in range(1000)]
    owners = partitions_of(keys, 4)
    assert owners == [partition_of(k, 4) for k in keys]
    assert all(200 < owners.count(p) < 300 for p in range(4))  # spread


def test_stray_finds_the_first_key_of_another_partition() -> None:
    keys = [b"key-%d" % i for i in range(1000)]
    owners = partitions_of(keys, 3)
    mine = [k for k, owner in zip(keys, owners, strict=True) if owner == 2]
    assert stray(mine, 2, 3) is None
    assert stray([], 2, 3) is None
    other = next(k for k, owner in zip(keys, owners, strict=True) if owner != 2)
    assert stray([*mine[:5], other, *mine[5:]], 2, 3) == 5
    assert stray([other], 2, 3) == 0


def test_a_ticket_names_one_client_one_key_its_number_and_its_time() -> None:
    secret, key = b"s" * 32, b"k" * 32
    issued = ticket(secret, "client", key, 7, 1000)
    assert ticket_number(secret, "client", key, issued, 1000) == 7
    assert ticket_number(secret, "client", key, issued, 1000 + TICKET_TTL_MS) == 7
    assert ticket_number(secret, "client", key, issued, 1001 + TICKET_TTL_MS) is None  # late
    assert ticket_number(secret, "client", key, issued, 999) is None  # not issued yet
    assert ticket_number(secret, "client2", key, issued, 1000) is None
    assert ticket_number(secret, "client", b"x" * 32, issued, 1000) is None
    assert ticket_number(b"t" * 32, "client", key, issued, 1000) is None
    assert ticket_number(secret, "client", key, issued[:-1], 1000) is None
    assert ticket_number(secret, "client", key, "not bytes", 1000) is None
    # the number and the time are signed: neither can be changed
    for changed in (ticket(secret, "client", key, 8, 1000)[:16] + issued[16:],
                    ticket(secret, "client", key, 7, 5000)[:16] + issued[16:]):
        assert ticket_number(secret, "client", key, changed, 5000) is None
    # the id's length is signed: ("ab", "c...") and ("a", "bc...") differ
    assert ticket(secret, "ab", b"c" * 32, 1, 0) != ticket(secret, "a", b"b" + b"c" * 32, 1, 0)


class _Observer:
    def rpc_done(self, method: str, transport: str, duration_s: float, failed: bool) -> None:
        pass


def _servicer(terms: PartitionTerms) -> Servicer:
    core = MasterCore(CoreConfig(partition_index=terms.index, partition_count=terms.count))
    return Servicer(core, ServingClock(), _Observer(), master_id="m",
                    on_events=lambda events: True, status_document=lambda: iter(["{}"]),
                    partition=terms)


def _serve(servicer: Servicer, call: calls.Call[Any]) -> Any:
    answer = servicer.serve(call.method, call.request.SerializeToString(), "test")
    assert isinstance(answer, bytes)
    return call.decode(call.method.response_type.FromString(answer))


def test_partition_0_registers_and_the_others_join_only_with_its_ticket() -> None:
    first, second = PartitionTerms.drawn(2)
    zero, one = _servicer(first), _servicer(second)
    assert zero.capability_epoch == one.capability_epoch == first.epoch
    assert abs(zero.capability_clock_ms() - one.capability_clock_ms()) <= 1
    # until every partition serves, partition 0 registers nobody
    assert _serve(zero, calls.register_client("c", "h", "", b"")).status == Status.UNAVAILABLE
    zero.partition_map = (PartitionEndpoint(1, 2), PartitionEndpoint(3, 4, "sock", 99))
    answer = _serve(zero, calls.register_client("c", "h", "", b""))
    assert answer.status == Status.OK and answer.partitions == zero.partition_map
    key, issued = answer.capability_key, answer.partition_ticket
    # a later partition: no ticket, another client's, a forged one, another key
    for token, joining_key, presented in ((answer.client_token, b"", b""),
                                          (b"", key, ticket(second.secret, "d", key, 1,
                                                            zero.capability_clock_ms())),
                                          (b"", key, b"f" * 32),
                                          (b"", b"x" * 32, issued)):
        refused = _serve(one, calls.register_client("c", "h", "", token, joining_key, presented))
        assert refused.status == Status.PERMISSION_DENIED and refused.capability_key == b""
    assert _serve(one, calls.heartbeat("c", answer.client_token))[0] == Status.UNKNOWN_CLIENT
    joined = _serve(one, calls.register_client("c", "h", "", b"", key, issued))
    assert joined.status == Status.OK and joined.capability_key == key
    assert joined.client_token == answer.client_token == client_token(key)
    assert joined.partitions == () and joined.partition_ticket == b""
    # the client's token now works on both
    for servicer in (zero, one):
        assert _serve(servicer, calls.heartbeat("c", answer.client_token))[0] == Status.OK
    # partition 0 is not joined: a ticket there is not a registration
    assert _serve(zero, calls.register_client("e", "h", "", b"", key, issued)).capability_key \
        != key


def test_a_join_under_a_new_key_lets_the_earlier_holder_of_the_id_go() -> None:
    core = MasterCore(CoreConfig(partition_index=1, partition_count=2))
    old, new = b"o" * 32, b"n" * 32
    assert core.join_client(ClientId("c"), "h", old, 0.0, 3) == (Status.OK, old)
    segment = SegmentInfo(SegmentId("s"), ClientId("c"), 8 * MiB)
    assert core.mount_segment(segment, 0.0) == Status.OK
    core.put_start(ClientId("c"), [b"a"], [4096], PutOptions(), 0.0)
    assert core.put_end(ClientId("c"), [b"a"], 0.0) == [Status.OK]
    assert core.join_client(ClientId("c"), "h", b"short", 1.0, 4) == \
        (Status.INVALID_ARGUMENT, b"")
    assert core.exist([b"a"], 1.0)[0] == [Status.OK]   # a malformed join changed nothing
    assert core.join_client(ClientId("c"), "h", old, 1.0, 5) == (Status.OK, old)  # the same one
    assert core.exist([b"a"], 1.0)[0] == [Status.OK]
    # a ticket of another key older than the one the holder joined with: an earlier holder's
    assert core.join_client(ClientId("c"), "h", new, 1.5, 4) == \
        (Status.CLIENT_ALREADY_EXISTS, b"")
    assert core.exist([b"a"], 1.5)[0] == [Status.OK]
    assert core.authenticate(ClientId("c"), client_token(old)) == Status.OK
    assert core.join_client(ClientId("c"), "h", new, 2.0, 6) == (Status.OK, new)
    assert core.exist([b"a"], 2.0)[0] == [Status.NOT_FOUND]   # the earlier holder's are gone
    assert core.get_segments(["s"]) == [None]
    assert core.authenticate(ClientId("c"), client_token(new)) == Status.OK
    assert core.authenticate(ClientId("c"), client_token(old)) == Status.UNKNOWN_CLIENT


# -- the state directory -------------------------------------------------------------------------

def test_a_state_directory_is_opened_only_with_the_count_it_was_written_with(
        tmp_path: Path) -> None:
    claim_state_dir("", 4)   # no state directory: nothing to check
    split = tmp_path / "split"
    claim_state_dir(str(split), 2)
    assert (split / "partitions").read_text() == "2\n"
    claim_state_dir(str(split), 2)
    for count in (1, 3):
        with pytest.raises(StateLayoutError, match="--partitions 2"):
            claim_state_dir(str(split), count)
    whole = tmp_path / "whole"
    whole.mkdir()
    (whole / "master_id").write_text("x\n")
    claim_state_dir(str(whole), 1)
    with pytest.raises(StateLayoutError, match="one process"):
        claim_state_dir(str(whole), 2)
    assert state_dir_of(str(split), PartitionTerms(1, 2)) == str(split / "partition-1")
    assert state_dir_of(str(whole), PartitionTerms()) == str(whole)
    # a first start killed between writing the count and renaming it left only that file
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "partitions.tmp").write_text("")
    claim_state_dir(str(cut), 2)
    assert (cut / "partitions").read_text() == "2\n" and not (cut / "partitions.tmp").exists()
    volume = tmp_path / "volume"   # a freshly formatted volume mounted as the directory
    (volume / "lost+found").mkdir(parents=True)
    claim_state_dir(str(volume), 4)
    assert (volume / "partitions").read_text() == "4\n"


# -- a client's routing --------------------------------------------------------------------------

class _Routing(MasterCalls):
    """MasterCalls over a session, to look at the calls it would make."""

    def __init__(self, partitions: int, most: int) -> None:
        self.session = MasterSession()
        self.session.learn_partitions(tuple(PartitionEndpoint(p) for p in range(partitions)),
                                      b"")
        self.session.max_call_keys = most


def test_a_batch_goes_to_the_partitions_of_its_keys_in_order() -> None:
    keys = [b"k%d" % i for i in range(50)]
    routes = _Routing(3, 7)._routes(keys)
    seen = sorted(p for _, positions in routes for p in positions)
    assert seen == list(range(50))
    for partition, positions in routes:
        assert 0 < len(positions) <= 7 and list(positions) == sorted(positions)
        assert all(partition_of(keys[p], 3) == partition for p in positions)
    assert _Routing(1, 7)._routes(keys)[0] == (0, range(0, 7))
    assert _Routing(3, 7)._routes([]) == [(0, range(0))]


def test_answers_join_at_their_keys_positions() -> None:
    routes: list[Any] = [(0, [0, 3]), (1, [1]), (0, [4]), (2, [2, 5])]
    timeout = KVPoolError(Status.TIMEOUT, "part")
    assert joined_lists(routes, lambda s: s, [["a", "d"], timeout, ["e"], ["c", "f"]]) == \
        ["a", Status.TIMEOUT, "c", "d", "e", "f"]
    read = [ReadResult(0, i, (), 0) for i in range(6)]
    answer = joined_replicas(routes, [ReplicasAnswer([read[0], read[3]], 5.0, (3,)),
                                      ReplicasAnswer([read[1]], 4.0, (7,)),
                                      ReplicasAnswer([read[4]], 5.0, (6,)),
                                      ReplicasAnswer([read[2], read[5]], 5.0, (5,))])
    assert list(answer.results) == read and answer.lease_ttl_s == 4.0
    assert sorted(answer.lease_ids) == [3, 5, 6, 7]


def test_a_prefix_ends_at_the_first_key_any_partition_lacks() -> None:
    routes: list[Any] = [(0, [0, 2, 4]), (1, [1, 3, 5])]
    assert joined_prefix(routes, [3, 3]) == 6
    assert joined_prefix(routes, [3, 1]) == 3     # partition 1 lacks key 3
    assert joined_prefix(routes, [1, 3]) == 2
    assert joined_prefix(routes, [0, 3]) == 0
    assert joined_prefix(routes, [3, KVPoolError(Status.TIMEOUT, "x")]) == 1
    with pytest.raises(KVPoolError):
        joined_prefix(routes, [KVPoolError(Status.TIMEOUT, "x"), 3])
    assert joined_prefix([(0, range(0, 3)), (0, range(3, 6))], [3, 2]) == 5


def test_a_call_on_every_partition_fails_as_one_call_would() -> None:
    assert all_ok([Status.OK, Status.OK]) == Status.OK
    assert all_ok([Status.OK, Status.UNKNOWN_CLIENT]) == Status.UNKNOWN_CLIENT
    # a part that raised raises: a mount that waits for a sweep is asked again on TIMEOUT
    with pytest.raises(KVPoolError) as raised:
        all_ok([Status.UNKNOWN_CLIENT, KVPoolError(Status.TIMEOUT, "part")])
    assert raised.value.status == Status.TIMEOUT


def test_ended_leases_go_to_the_partition_their_number_names() -> None:
    routing = _Routing(3, 100)
    routing.session.end_lease([3, 4, 5, 7, 9], [b"k"])
    keys = [b"k%d" % i for i in range(6)]
    routes = [(p, [i for i, k in enumerate(keys) if partition_of(k, 3) == p])
              for p in (0, 1)]   # no call to partition 2 in this batch
    ended = routing._ended_for(routes)  # type: ignore[arg-type]
    assert [sorted(e) for e in ended] == [[3, 9], [4, 7]]
    assert routing.session.take_ended() == [5]   # partition 2's waits for a call there


def test_status_documents_of_partitions_merge() -> None:
    def document(capacity: int, ready: int) -> dict[str, Any]:
        return {"clients": 2, "capacity_bytes": {"DRAM": capacity}, "objects": {"ready": ready},
                "segments": {"mounted": 1, "list": [{"segment_id": "s", "capacity_bytes":
                                                     capacity, "used_bytes": 1,
                                                     "free_extents": 1,
                                                     "largest_free_bytes": capacity}]}}
    merged = merged_status([{**document(10, 3), "totals": {"clients_registered_total": 3,
                                                           "put_committed_total": 5}},
                            {**document(12, 4), "stalled_s": 2.5,
                             "totals": {"clients_registered_total": 2,
                                        "put_committed_total": 6}}])
    # a client registers with every partition: counted once; the partitions' puts add up
    assert merged["totals"] == {"clients_registered_total": 3, "put_committed_total": 11}
    assert merged["clients"] == 2 and merged["partitions"] == 2
    assert merged["stalled_s"] == 2.5     # the longest stall of any partition
    assert [(row["index"], row["ready"]) for row in merged["partition_list"]] == [(0, 3), (1, 4)]
    assert merged["capacity_bytes"] == {"DRAM": 22} and merged["objects"] == {"ready": 7}
    assert merged["segments"]["list"][0]["capacity_bytes"] == 22
    assert merged["segments"]["list"][0]["largest_free_bytes"] == 12

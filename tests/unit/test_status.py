"""The Python Status enum mirrors the proto enum exactly (names and numbers)."""

from __future__ import annotations

from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.status import RETRYABLE, KVPoolError, Status


def test_status_enum_matches_proto() -> None:
    proto = {name.removeprefix("STATUS_"): number
             for name, number in pb.Status.items()}
    python = {member.name: int(member) for member in Status}
    assert python == proto


def test_mooncake_numbers_are_reused() -> None:
    assert Status.NO_SPACE == -200
    assert Status.INVALID_ARGUMENT == -600
    assert Status.NOT_FOUND == -704
    assert Status.ALREADY_EXISTS == -705
    assert Status.HAS_LEASE == -706
    assert Status.LEASE_EXPIRED == -707
    assert Status.TRANSFER_FAILED == -800
    assert Status.RPC_FAILED == -900


def test_error_carries_status() -> None:
    err = KVPoolError(Status.NOT_FOUND, "key k")
    assert err.status is Status.NOT_FOUND
    assert not err.retryable
    assert "NOT_FOUND" in str(err) and "-704" in str(err)
    assert KVPoolError(Status.RPC_FAILED).retryable
    assert Status.NOT_FOUND not in RETRYABLE

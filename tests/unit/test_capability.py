"""Capabilities: a keyed state reused across a batch, and an answer's signer, sign exactly what a
fresh key does, and verification binds every field."""

from __future__ import annotations

import os

from kvpool_wire import capability
from kvpool_wire.types import Extent, Op, SegmentId


def test_a_reused_keyed_state_signs_like_a_fresh_key() -> None:
    key = os.urandom(capability.KEY_BYTES)
    state = capability.keyed(key)
    fields = [("seg-a", 0, 4096, Op.WRITE, 1_000), ("seg-b", 1 << 30, 1, Op.READ, 2_000),
              ("seg-a", 0, 4096, Op.WRITE, 1_000)]
    signed = [capability.sign_keyed(state, *f) for f in fields]
    assert signed == [capability.sign(key, *f) for f in fields]
    assert signed[0] == signed[2] and signed[0] != signed[1]
    assert all(len(c) == capability.CAPABILITY_BYTES for c in signed)


def test_an_answers_signers_sign_like_a_fresh_key_and_key_each_segment_once() -> None:
    keys = {"seg-a": os.urandom(capability.KEY_BYTES), "seg-b": os.urandom(capability.KEY_BYTES)}
    looked_up: list[str] = []

    def segment_key(segment_id: SegmentId) -> bytes | None:
        looked_up.append(segment_id)
        return keys.get(segment_id)

    extents = [Extent(SegmentId("seg-a"), 0, 4096), Extent(SegmentId("seg-b"), 1 << 40, 7),
               Extent(SegmentId("seg-a"), 8192, 4096), Extent(SegmentId("gone"), 0, 4096),
               Extent(SegmentId("seg-a"), 0, 4096), Extent(SegmentId("gone"), 64, 1)]
    for op, expiry_ms, epoch, put_id in ((Op.WRITE, 1_000, 7, 3), (Op.READ, 2**63, 2**64 - 1, 0)):
        looked_up.clear()
        capability_of = capability.extent_signer(segment_key, op, expiry_ms, epoch, put_id)
        signed = [capability_of(e) for e in extents]
        assert signed == [
            capability.sign(keys[e.segment_id], e.segment_id, e.offset, e.length, op, expiry_ms,
                            epoch, put_id) if e.segment_id in keys else b"" for e in extents]
        assert signed[0] == signed[4] and len(set(signed[:3])) == 3
        assert sorted(looked_up) == ["gone", "seg-a", "seg-b"]
        looked_up.clear()
        capabilities_of_run = capability.run_signer(segment_key, op, expiry_ms, epoch, put_id)
        for segment_id, offsets, length in (("seg-a", [0, 8192, 0, 2**64 - 1], 4096),
                                            ("seg-b", [1 << 40], 7), ("gone", [0, 64], 1),
                                            ("seg-a", [], 4096)):
            assert capabilities_of_run(SegmentId(segment_id), offsets, length) == [
                capability_of(Extent(SegmentId(segment_id), offset, length))
                for offset in offsets]
        assert sorted(looked_up) == ["gone", "seg-a", "seg-b"]   # once each
        looked_up.clear()
        capabilities_of = capability.columns_signer(segment_key, op, expiry_ms, epoch, put_id)
        with_none = [*extents, Extent(SegmentId(""), 0, 0)]
        for chosen in (extents, with_none, with_none[::-1], extents[:2], []):
            assert capabilities_of([e.segment_id for e in chosen], [e.offset for e in chosen],
                                   [e.length for e in chosen]) == [
                capability_of(e) if e.segment_id else b"" for e in chosen]
        assert sorted(looked_up) == ["gone", "seg-a", "seg-b"]   # once each, none for ""


def test_verify_binds_every_field_and_the_expiry() -> None:
    key = os.urandom(capability.KEY_BYTES)
    cap = capability.sign(key, "seg", 64, 128, Op.READ, 5_000)
    assert capability.verify(key, cap, "seg", 64, 128, Op.READ, 5_000, now_ms=4_999)
    changed = [("seg2", 64, 128, Op.READ, 5_000), ("seg", 65, 128, Op.READ, 5_000),
               ("seg", 64, 127, Op.READ, 5_000), ("seg", 64, 128, Op.WRITE, 5_000),
               ("seg", 64, 128, Op.READ, 5_001)]
    for fields in changed:
        assert not capability.verify(key, cap, *fields, now_ms=0)
    assert not capability.verify(key, cap, "seg", 64, 128, Op.READ, 5_000, now_ms=5_001)
    assert not capability.verify(os.urandom(capability.KEY_BYTES), cap, "seg", 64, 128,
                                 Op.READ, 5_000, now_ms=0)

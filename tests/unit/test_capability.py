"""Capabilities: a keyed state reused across a batch signs exactly what a fresh key does, and
verification binds every field."""

from __future__ import annotations

import os

from kvpool_wire import capability
from kvpool_wire.types import Op


def test_a_reused_keyed_state_signs_like_a_fresh_key() -> None:
    key = os.urandom(capability.KEY_BYTES)
    state = capability.keyed(key)
    fields = [("seg-a", 0, 4096, Op.WRITE, 1_000), ("seg-b", 1 << 30, 1, Op.READ, 2_000),
              ("seg-a", 0, 4096, Op.WRITE, 1_000)]
    signed = [capability.sign_keyed(state, *f) for f in fields]
    assert signed == [capability.sign(key, *f) for f in fields]
    assert signed[0] == signed[2] and signed[0] != signed[1]
    assert all(len(c) == capability.CAPABILITY_BYTES for c in signed)


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

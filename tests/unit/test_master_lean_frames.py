"""Lean framing: frames survive any split of the byte stream; bad lengths are refused."""

from __future__ import annotations

import pytest

from kvpool_wire._pb import kvpool_pb2
from kvpool_wire.framing import (
    ERROR_METHOD_ID,
    FrameDecoder,
    FrameError,
    encode_frame,
    error_reason,
)
from kvpool_wire.status import Status


def test_frames_survive_every_split_point() -> None:
    stream = (encode_frame(21, 1, b"abc") + encode_frame(10, 2, b"") +
              encode_frame(255, 0xFFFFFFFF, b"x" * 300))
    expected = [(21, 1, b"abc"), (10, 2, b""), (255, 0xFFFFFFFF, b"x" * 300)]
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder(1024)
        frames = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert frames == expected, cut
    decoder = FrameDecoder(1024)
    assert [f for i in range(len(stream)) for f in decoder.feed(stream[i:i + 1])] == expected


@pytest.mark.parametrize("length", [0, 4, 1025 + 5])
def test_bad_lengths_are_refused_before_buffering(length: int) -> None:
    decoder = FrameDecoder(1024)
    with pytest.raises(FrameError):
        decoder.feed(length.to_bytes(4, "little"))


def test_error_payload_names_a_status() -> None:
    assert error_reason(b"PERMISSION_DENIED: token") == (Status.PERMISSION_DENIED, "token")
    assert error_reason(b"garbage \xff") == (Status.RPC_FAILED, "garbage \ufffd")


def test_the_error_method_id_matches_the_proto() -> None:
    assert ERROR_METHOD_ID == kvpool_pb2.METHOD_ERROR

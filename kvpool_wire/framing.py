"""Lean framing: the byte layout shared by the master's fast port and the client stub.

A frame is ``u32 LE length of what follows | u8 method | u32 LE request id | payload``; the
payload is the protobuf message of the method (see ``Method`` in proto/kvpool.proto). An answer
echoes method and request id. Method 255 carries ``"STATUS_NAME: reason"`` and ends the
connection. This module only splits and joins bytes; it knows no message types.
"""

from __future__ import annotations

import struct

from kvpool_wire.status import Status

#: ``u32 length of what follows | u8 method | u32 request id``, little-endian.
FRAME_HEADER = struct.Struct("<IBI")
FRAME_LENGTH = struct.Struct("<I")
FRAME_METHOD_ID = struct.Struct("<BI")
FRAME_OVERHEAD_BYTES = 5  # method + request id, counted in the length
#: The method of the error frame that ends a connection (``METHOD_ERROR`` in proto/).
ERROR_METHOD_ID = 255


class FrameError(ValueError):
    """A lean-framing byte stream that cannot be parsed (bad length)."""


class FrameDecoder:
    """Splits a byte stream into ``(method, request_id, payload)`` frames."""

    __slots__ = ("_buffer", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int) -> None:
        self._buffer = bytearray()
        #: Longest frame accepted (length field); may be changed between feeds, e.g. raised
        #: once the peer has authenticated.
        self.max_frame_bytes = max_frame_bytes

    @property
    def pending_bytes(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buffer)

    def feed(self, data: bytes, max_frames: int = -1) -> list[tuple[int, int, bytes]]:
        """Append ``data``; return the complete frames, at most ``max_frames`` of them when it
        is not negative (the rest stays buffered, its lengths not yet checked: a later feed,
        e.g. ``feed(b"")``, returns it). Raises FrameError on a bad length."""
        buffer = self._buffer
        if buffer:
            buffer += data
            view: bytes | bytearray = buffer
        else:
            view = data
        frames: list[tuple[int, int, bytes]] = []
        pos = 0
        size = len(view)
        with memoryview(view) as whole:  # released before the buffer is resized below
            while size - pos >= 4 and len(frames) != max_frames:
                (length,) = FRAME_LENGTH.unpack_from(view, pos)
                if length < FRAME_OVERHEAD_BYTES or length > self.max_frame_bytes:
                    raise FrameError(f"frame length {length} outside "
                                     f"[5, {self.max_frame_bytes}]")
                end = pos + 4 + length
                if end > size:
                    break
                method, request_id = FRAME_METHOD_ID.unpack_from(view, pos + 4)
                frames.append((method, request_id, bytes(whole[pos + 9:end])))
                pos = end
        if view is buffer:
            del buffer[:pos]
        elif pos < size:
            self._buffer = bytearray(view[pos:])
        return frames


def encode_frame(method: int, request_id: int, payload: bytes) -> bytes:
    """One lean frame."""
    return FRAME_HEADER.pack(len(payload) + FRAME_OVERHEAD_BYTES, method, request_id) + payload


def error_reason(payload: bytes) -> tuple[Status, str]:
    """(status, text) of a METHOD_ERROR payload written as ``"STATUS_NAME: reason"``."""
    text = payload.decode("utf-8", "replace")
    name, _, rest = text.partition(": ")
    status = Status.__members__.get(name)
    return (status, rest) if status is not None else (Status.RPC_FAILED, text)

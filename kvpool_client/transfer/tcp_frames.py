"""TCP data plane: the wire format, shared by the data server (``tcp``) and its clients
(``tcp_client``, ``tcp_blocking``). Pure: no sockets, no threads.

Wire format, version 2 (integers little-endian). One TCP connection carries a sequence of
requests; the server answers them in order, so a client may pipeline.

Request = header (80 bytes) + segment id (UTF-8) + payload (WRITE only, ``length`` bytes)::

    off  size  field
      0     4  magic          b"KVPQ"
      4     1  version        2
      5     1  op             1 READ, 2 WRITE (kvpool_wire.types.Op)
      6     2  seg_id_len     1..255, bytes of the segment id that follows the header
      8     8  request_id     chosen by the client, echoed by the response
     16     8  offset         first byte of the request in the segment
     24     8  length         bytes to move, >= 1
     32     8  cap_offset     the range the capability covers: the request must lie inside
     40     8  cap_length       [cap_offset, cap_offset + cap_length)
     48     8  cap_expiry_ms  the master's capability clock (ms) after which it is refused
     56     8  put_id         WRITE: the put the capability belongs to (0 for READ)
     64    16  capability     capability.sign(owner key, segment id, cap_offset, cap_length,
                              op, cap_expiry_ms, epoch, put_id): the master's signature

Response = header (28 bytes) + message (UTF-8, ``msg_len`` bytes) + payload::

    off  size  field
      0     4  magic          b"KVPR"
      4     1  version        2
      5     1  reserved       0
      6     2  msg_len        0..1024, a human-readable reason when status is not OK
      8     4  status         int32, a kvpool_wire.status.Status value
     12     8  request_id     of the request answered (0 when the frame was unreadable)
     20     8  length         payload bytes after the message: the request's length for a
                              READ answered OK, 0 otherwise

A response with request id 0 and a status other than OK answers no request: the server refused
the connection (too many connections) or a frame it could not read, and closes the connection
after it. Any other non-OK answer refuses only its request; the connection stays usable.

Clients cut a placement larger than their chunk size into several requests (sub-ranges under
the same capability): ``chunks``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op, Placement

REQUEST_MAGIC = b"KVPQ"
RESPONSE_MAGIC = b"KVPR"
VERSION = 2
REQUEST = struct.Struct("<4sBBHQQQQQQQ16s")
RESPONSE = struct.Struct("<4sBxHiQQ")
MAX_SEGMENT_ID_BYTES = 255
MAX_MESSAGE_BYTES = 1024

_STATUS_OF_CODE = {int(status): status for status in Status}


def encode_request(op: Op, request_id: int, segment_id: str, offset: int, length: int,
                   cap_offset: int, cap_length: int, cap_expiry_ms: int,
                   cap: bytes, put_id: int = 0) -> bytes:
    """Return a request header followed by the segment id (the payload is sent separately)."""
    seg = segment_id.encode()
    return REQUEST.pack(REQUEST_MAGIC, VERSION, int(op), len(seg), request_id, offset, length,
                        cap_offset, cap_length, cap_expiry_ms, put_id, cap) + seg


def encode_response(status: Status, request_id: int, length: int = 0, message: str = "") -> bytes:
    """Return a response header followed by its message (the payload is sent separately)."""
    text = message.encode()[:MAX_MESSAGE_BYTES]
    return RESPONSE.pack(RESPONSE_MAGIC, VERSION, len(text), int(status), request_id,
                         length) + text


def parse_response(header: bytes | bytearray | memoryview, request_id: int, op: Op,
                   length: int) -> tuple[Status, int, bool]:
    """Check a response header against the request it must answer, the oldest one pending on
    its connection (``request_id`` 0: none is pending).

    Returns (status, message bytes that follow, whether it ends the connection: request id 0
    with an error). A READ answered OK is followed by ``length`` payload bytes, anything else
    by none. Raises KVPoolError TRANSFER_FAILED when the header is malformed (magic, version,
    message length, unknown status), answers another request, or announces another payload
    length; the connection's stream position is then lost.
    """
    magic, version, msg_len, code, answered_id, answered_length = RESPONSE.unpack(header)
    status = _STATUS_OF_CODE.get(code)
    connection_error = answered_id == 0 and status != Status.OK
    if (magic != RESPONSE_MAGIC or version != VERSION or msg_len > MAX_MESSAGE_BYTES
            or status is None
            or not (connection_error or (request_id != 0 and answered_id == request_id))):
        raise KVPoolError(Status.TRANSFER_FAILED, "malformed answer from data server")
    expected = length if request_id != 0 and status == Status.OK and op == Op.READ else 0
    if answered_length != expected:
        raise KVPoolError(Status.TRANSFER_FAILED,
                          f"data server answered {answered_length} bytes, expected {expected}")
    return status, msg_len, connection_error


def refusal(status: Status, message: bytes | bytearray) -> KVPoolError:
    """The error of a non-OK answer, with the server's message as its reason."""
    return KVPoolError(status, bytes(message).decode(errors="replace")
                       or "refused by the data server")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``). Raises KVPoolError INVALID_ARGUMENT."""
    host, sep, port_text = endpoint.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise KVPoolError(Status.INVALID_ARGUMENT, f"bad tcp endpoint {endpoint!r}")
    return host, int(port_text)


def chunks(placement: Placement, views: Sequence[memoryview], chunk_bytes: int,
           ) -> list[tuple[int, int, list[memoryview]]]:
    """Cut a placement into requests of at most ``chunk_bytes``: (offset, length, regions)."""
    out: list[tuple[int, int, list[memoryview]]] = []
    offset = placement.offset
    current: list[memoryview] = []
    room = chunk_bytes
    for view in views:
        start = 0
        while start < view.nbytes:
            take = min(room, view.nbytes - start)
            current.append(view[start:start + take])
            start += take
            room -= take
            if room == 0:
                out.append((offset, chunk_bytes, current))
                offset += chunk_bytes
                current, room = [], chunk_bytes
    if current:
        out.append((offset, chunk_bytes - room, current))
    return out

"""The byte layout of a tensor object, as Mooncake 0.3.13's ``put_tensor`` writes it: a 304-byte
header, then the tensor's bytes in row-major order.

Rules of this file:
- Header (little-endian): ``magic u32 = 0x4d4f4f4e, version u16 = 1, header_size u16 = 304,
  dtype i32, ndim i32, layout_kind u32 (0 full, 1 shard), reserved u32 = 0, data_offset u64 =
  304, data_bytes u64``; then the layout: ``global_shape i64[8]``, ``local_shape i64[8]``
  (unused dimensions -1), ``axis_count u32, reserved u32``, four axes of ``kind i32,
  axis_index i32, shard_rank i32, shard_count i32, split_dim i32, reserved i32, reserved i64``.
  A shard written by the ``*_with_tp`` calls has one axis of kind TP (1).
- :func:`decode` checks what Mooncake's reader checks (magic, version, sizes, dtype, dims,
  axes, ``data_bytes`` equal to the shape's bytes and to what follows the header), and that a
  whole tensor's global and local shapes agree; it answers None for anything else: bytes that
  are not a tensor object never become a tensor.
- Pure: no torch here; dtypes are named as torch names them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
HEADER_BYTES = 304
LAYOUT_FULL, LAYOUT_SHARD = 0, 1
AXIS_TP = 1
_AXIS_KIND_MAX = 4  # DP, TP, EP, PP, RESERVED

#: Mooncake's dtype numbers: index -> (torch name, bytes per element).
DTYPES: tuple[tuple[str, int], ...] = (
    ("float32", 4), ("float64", 8), ("int8", 1), ("uint8", 1), ("int16", 2), ("uint16", 2),
    ("int32", 4), ("uint32", 4), ("int64", 8), ("uint64", 8), ("bool", 1), ("float16", 2),
    ("bfloat16", 2), ("float8_e4m3fn", 1), ("float8_e5m2", 1),
)
DTYPE_NUMBERS = {name: number for number, (name, _) in enumerate(DTYPES)}

_HEAD = struct.Struct("<IHHiiIIQQ")  # 40 bytes
_SHAPE = struct.Struct(f"<{MAX_DIMS}q")  # 64 bytes
_AXES_HEAD = struct.Struct("<II")
_AXIS = struct.Struct("<iiiiiiq")  # 32 bytes
assert _HEAD.size + 2 * _SHAPE.size + _AXES_HEAD.size + MAX_AXES * _AXIS.size == HEADER_BYTES


@dataclass(frozen=True, slots=True)
class Shard:
    """Where a tensor-parallel shard sits in its whole tensor."""

    rank: int
    count: int
    split_dim: int


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """What the header says of the tensor that follows it."""

    dtype: str  # torch's name
    shape: tuple[int, ...]  # of the bytes stored (a shard's own shape)
    global_shape: tuple[int, ...]
    shard: Shard | None = None

    @property
    def data_bytes(self) -> int:
        """Bytes of the tensor's elements."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPES[DTYPE_NUMBERS[self.dtype]][1]


def encode(header: TensorHeader) -> bytes:
    """The 304 header bytes of ``header``. Raises ValueError for a dtype Mooncake has no number
    for, or more than eight dimensions."""
    number = DTYPE_NUMBERS.get(header.dtype)
    if number is None:
        raise ValueError(f"dtype {header.dtype} has no Mooncake tensor number")
    if len(header.shape) > MAX_DIMS or len(header.global_shape) != len(header.shape):
        raise ValueError(f"a tensor object holds 0 to {MAX_DIMS} dimensions, "
                         f"got {len(header.shape)}")
    shard = header.shard
    out = bytearray(HEADER_BYTES)
    _HEAD.pack_into(out, 0, MAGIC, VERSION, HEADER_BYTES, number, len(header.shape),
                    LAYOUT_SHARD if shard else LAYOUT_FULL, 0, HEADER_BYTES, header.data_bytes)
    at = _HEAD.size
    for shape in (header.global_shape, header.shape):
        _SHAPE.pack_into(out, at, *shape, *([-1] * (MAX_DIMS - len(shape))))
        at += _SHAPE.size
    _AXES_HEAD.pack_into(out, at, 1 if shard else 0, 0)
    if shard:
        _AXIS.pack_into(out, at + _AXES_HEAD.size, AXIS_TP, 0, shard.rank, shard.count,
                        shard.split_dim, 0, 0)
    return bytes(out)


def decode(data: bytes | bytearray | memoryview, total_bytes: int) -> TensorHeader | None:
    """The header at the start of ``data`` (at least its first 304 bytes) of an object of
    ``total_bytes``, or None when those bytes are not a tensor object."""
    if total_bytes < HEADER_BYTES or len(data) < HEADER_BYTES:
        return None
    (magic, version, header_size, number, ndim, layout_kind, _, data_offset,
     data_bytes) = _HEAD.unpack_from(data, 0)
    if (magic, version, header_size, data_offset) != (MAGIC, VERSION, HEADER_BYTES,
                                                      HEADER_BYTES):
        return None
    if not (0 <= number < len(DTYPES) and 0 <= ndim <= MAX_DIMS and layout_kind in (
            LAYOUT_FULL, LAYOUT_SHARD) and data_bytes == total_bytes - HEADER_BYTES):
        return None
    global_shape = _SHAPE.unpack_from(data, _HEAD.size)
    local_shape = _SHAPE.unpack_from(data, _HEAD.size + _SHAPE.size)
    for shape in (global_shape, local_shape):
        if min(shape[:ndim], default=0) < 0 or any(d != -1 for d in shape[ndim:]):
            return None
    if layout_kind == LAYOUT_FULL and global_shape != local_shape:
        return None
    at = _HEAD.size + 2 * _SHAPE.size
    axis_count, _ = _AXES_HEAD.unpack_from(data, at)
    if axis_count > MAX_AXES:
        return None
    axes = [_AXIS.unpack_from(data, at + _AXES_HEAD.size + i * _AXIS.size)
            for i in range(axis_count)]
    for kind, _, rank, count, split_dim, _, _ in axes:
        if not (0 <= kind <= _AXIS_KIND_MAX and 0 <= rank < count and -1 <= split_dim < ndim):
            return None
    tp = next((a for a in axes if a[0] == AXIS_TP), None)
    header = TensorHeader(DTYPES[number][0], tuple(local_shape[:ndim]),
                          tuple(global_shape[:ndim]),
                          Shard(tp[2], tp[3], tp[4]) if tp is not None else None)
    return header if header.data_bytes == data_bytes else None

"""Keys, caller buffers and regions: the shapes every client call is normalised into.

Rules of this file:
- An object is the concatenation of its regions (``list[memoryview]`` of unsigned bytes, in
  order); every public call is turned into (key bytes, regions) before anything else happens.
- Bad input raises :class:`KVPoolError` with ``INVALID_KEY`` / ``INVALID_ARGUMENT`` and a
  message saying what is wrong; nothing is sent to the master for it.
- No copies: views alias the caller's memory. ``alloc_bytes`` hands out a fresh ``bytes`` object
  together with a writable view of its storage, so ``get`` fills the object it returns directly.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Sequence
from typing import Any

from kvpool_client.core.regions import AddressRange, AnyRegions, Regions  # noqa: F401 (re-exported)
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import MAX_KEY_BYTES

KeyLike = str | bytes | bytearray | memoryview


def to_key(key: KeyLike) -> bytes:
    """Return the key as bytes (``str`` is UTF-8 encoded).

    Raises ``INVALID_KEY`` for an empty key, a key over ``MAX_KEY_BYTES`` or a non-key type.
    """
    if isinstance(key, str):
        raw = key.encode()
    elif isinstance(key, bytes):
        raw = key
    elif isinstance(key, bytearray | memoryview):
        raw = bytes(key)
    else:
        raise KVPoolError(Status.INVALID_KEY, f"a key is str or bytes, got {type(key).__name__}")
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise KVPoolError(Status.INVALID_KEY,
                          f"a key has 1 to {MAX_KEY_BYTES} bytes, got {len(raw)}")
    return raw


def byte_view(buf: Any, *, writable: bool = False) -> memoryview:
    """Return a flat unsigned-byte view of a buffer-protocol object (numpy array, bytearray, ...).

    Raises ``INVALID_ARGUMENT`` when it has no buffer interface, is not contiguous, or is
    read-only while ``writable`` is asked for.
    """
    if isinstance(buf, memoryview):
        view = buf
    else:
        try:
            view = memoryview(buf)
        except TypeError:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"{type(buf).__name__} does not expose a buffer") from None
    if writable and view.readonly:
        raise KVPoolError(Status.INVALID_ARGUMENT, "the destination buffer is read-only")
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise KVPoolError(Status.INVALID_ARGUMENT, "the buffer is not contiguous")
    return view.cast("B")


def slice_view(view: memoryview, offset: int, size: int) -> memoryview:
    """Return ``view[offset:offset+size]``; INVALID_ARGUMENT when it falls outside the buffer."""
    if isinstance(offset, bool) or isinstance(size, bool) or not isinstance(offset, int) \
            or not isinstance(size, int):
        raise KVPoolError(Status.INVALID_ARGUMENT, "offset and size are integers")
    if offset < 0 or size < 0 or offset + size > view.nbytes:
        raise KVPoolError(Status.INVALID_ARGUMENT,
                          f"range [{offset}, {offset + size}) lies outside a buffer of "
                          f"{view.nbytes} bytes")
    return view[offset:offset + size]


def regions_of(parts: Sequence[Any], *, writable: bool = False) -> AnyRegions:
    """Return the byte views of one object's regions (``AddressRange`` ones as they are);
    ``INVALID_ARGUMENT`` for a bad region."""
    if isinstance(parts, str | bytes | bytearray | memoryview) or not isinstance(parts, Sequence):
        raise KVPoolError(Status.INVALID_ARGUMENT, "the regions of a key are a list of buffers")
    return [part if type(part) is AddressRange else byte_view(part, writable=writable)
            for part in parts]


# --- fresh bytes filled in place ---

def _make_alloc_bytes() -> Any:
    if sys.implementation.name != "cpython":
        return None
    make = ctypes.pythonapi.PyBytes_FromStringAndSize
    make.restype = ctypes.py_object
    make.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    data_offset = bytes.__basicsize__ - 1  # offsetof(PyBytesObject, ob_sval)

    def alloc(size_bytes: int) -> tuple[bytes, memoryview]:
        obj: bytes = make(None, size_bytes)
        array = (ctypes.c_char * size_bytes).from_address(id(obj) + data_offset)
        return obj, memoryview(array).cast("B")

    # NOTE: CPython documents that a bytes object made from NULL may be filled before it is
    # shared; check the layout assumption once instead of trusting it blindly.
    probe, view = alloc(8)
    view[:] = b"kvpool!\x01"
    return alloc if probe == b"kvpool!\x01" else None


_alloc_in_place = _make_alloc_bytes()


def alloc_bytes(size_bytes: int) -> tuple[bytes, memoryview]:
    """Return a new ``bytes`` of ``size_bytes`` and a writable view of its storage.

    The object must not be shared (hashed, returned) before the view has been filled.
    """
    if size_bytes == 0:
        return b"", memoryview(bytearray())
    if _alloc_in_place is not None:
        result: tuple[bytes, memoryview] = _alloc_in_place(size_bytes)
        return result
    # Fallback outside CPython: one extra copy when the caller converts with bytes().
    holder = bytearray(size_bytes)
    return bytes(holder), memoryview(holder)  # pragma: no cover


class BufferRegistry:
    """Buffers the caller registered: their views are built once and found again by address.

    Registration is optional for the native API (any buffer works); it saves re-deriving views on
    the hot path and lets pointer-based callers (the Mooncake surface) find the memory a raw
    address lies in.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._id_to_view: dict[int, memoryview] = {}
        self._id_to_range: dict[int, tuple[int, int]] = {}

    def register(self, buf: Any) -> memoryview:
        """Register ``buf`` (idempotent) and return its byte view."""
        view = byte_view(buf)
        with self._lock:
            self._id_to_view[id(buf)] = view
            self._id_to_range[id(buf)] = (address_of(view), view.nbytes)
        return view

    def unregister(self, buf: Any) -> None:
        """Forget ``buf``; ``INVALID_ARGUMENT`` when it was never registered."""
        with self._lock:
            if self._id_to_view.pop(id(buf), None) is None:
                raise KVPoolError(Status.INVALID_ARGUMENT, "buffer was not registered")
            del self._id_to_range[id(buf)]

    def view(self, buf: Any, *, writable: bool = False) -> memoryview:
        """Return the byte view of ``buf``: the registered one when there is one."""
        view = self._id_to_view.get(id(buf))
        if view is None:
            return byte_view(buf, writable=writable)
        if writable and view.readonly:
            raise KVPoolError(Status.INVALID_ARGUMENT, "the destination buffer is read-only")
        return view

    def find(self, address: int, size_bytes: int) -> memoryview | None:
        """Return a view of ``[address, address+size_bytes)`` in a registered buffer, or None."""
        with self._lock:
            for buf_id, (start, length) in self._id_to_range.items():
                if start <= address and address + size_bytes <= start + length:
                    offset = address - start
                    return self._id_to_view[buf_id][offset:offset + size_bytes]
        return None

    def __len__(self) -> int:
        return len(self._id_to_view)


def address_of(view: memoryview) -> int:
    """Return the address of the first byte of ``view`` (works for read-only views too)."""
    if view.nbytes == 0:
        return 0
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    import numpy as np  # only for read-only buffers, which ctypes cannot take

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)

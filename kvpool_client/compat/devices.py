"""Device memory behind raw pointers: CUDA through the CUDA runtime, Ascend NPU through ACL.

Rules of this file:
- Nothing here is imported or loaded until a pointer that is not host memory is registered: a
  host-only process never loads a device runtime.
- A runtime answers two questions: does it own an address (``locate``), and how to move bytes
  between ranges of that device memory and one host buffer holding them back to back
  (``to_host`` / ``from_host``, several ranges per call: a KV object is one range per layer's K
  and V). kvpool's data plane only moves host bytes, so device regions are staged through host
  buffers by the caller.
- CUDA: the small ranges of a call are gathered on the device (asynchronous device-to-device
  copies into a per-thread scratch buffer, freed when its thread ends) and cross to or from
  the host in one copy; large
  ranges, or all of them when no scratch can be had, are copied one by one. Copies run on the
  legacy default stream, as a plain ``cudaMemcpy`` would, and are complete when a call returns.
- When no runtime can claim a pointer, :func:`locate_device` raises ``INVALID_ARGUMENT`` with a
  message naming what is missing (torch with CUDA, or CANN's ``acl`` module / ``torch_npu``).
- A copy may run on any thread (MindIE's asyncWrite puts from a background thread): each runtime
  makes the owning device (CUDA) or context (ACL) current before copying.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvpool_wire.status import KVPoolError, Status


class DeviceRuntime(Protocol):
    """A device memory runtime that can copy between its memory and host memory."""

    name: str

    def locate(self, address: int) -> Any | None:
        """Return an opaque handle (device, context) when ``address`` is this runtime's memory."""

    def to_host(self, handle: Any, dst: memoryview, src_ranges: Sequence[tuple[int, int]]
                ) -> None:
        """Copy the device ``(address, size)`` ranges, back to back, into ``dst``."""

    def from_host(self, handle: Any, src: memoryview, dst_ranges: Sequence[tuple[int, int]]
                  ) -> None:
        """Copy ``src``, back to back, into the device ``(address, size)`` ranges."""


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """Where a registered device pointer lives: the runtime and its handle."""

    runtime: DeviceRuntime
    handle: Any


def buffer_address(view: memoryview) -> int:
    """Return the address of a writable host view (the staging buffers are ours, so writable)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0


class _CudaPointerAttributes(ctypes.Structure):
    # cudaPointerAttributes as of CUDA 13, which appended ``long reserved[8]`` (it must be
    # zero; ctypes zero-fills). CUDA 11 and 12 write only the first four fields, so the larger
    # struct serves them too; the CUDA 11/12 size alone lets CUDA 13 write 64 bytes past it.
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int),
                ("devicePointer", ctypes.c_void_p), ("hostPointer", ctypes.c_void_p),
                ("reserved", ctypes.c_long * 8)]


_CUDA_DEVICE, _CUDA_MANAGED = 2, 3
_CUDA_H2D, _CUDA_D2H, _CUDA_D2D = 1, 2, 3
#: Ranges at least this large are copied on their own (one copy already runs near full speed).
CUDA_DIRECT_MIN_BYTES = 1 << 20
#: Most device scratch memory one thread keeps for gathering small ranges.
CUDA_SCRATCH_MAX_BYTES = 16 << 20


def _mapped_libraries(prefix: str) -> list[str]:
    """Paths of the shared libraries named ``prefix*`` that this process has mapped."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            paths = {line.split()[-1] for line in f if prefix in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/") and Path(p).name.startswith(prefix))


class ThreadScratch:
    """One thread's device scratch, ``{device: (address, size in bytes)}``, kept in its
    thread-local state and freed when that goes, that is when the thread ends (or when the
    runtime is dropped)."""

    __slots__ = ("by_device", "_free")

    def __init__(self, free: Callable[[int], None]) -> None:
        self.by_device: dict[int, tuple[int, int]] = {}
        self._free = free

    def __del__(self) -> None:
        by_device, self.by_device = self.by_device, {}
        for address, _ in by_device.values():
            with contextlib.suppress(Exception):  # a runtime already shut down: nothing to do
                self._free(address)


class CudaRuntime:
    """CUDA device memory through ``libcudart`` (the copy torch's CUDA build already loaded)."""

    name = "cuda"

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(_CudaPointerAttributes),
                                                       ctypes.c_void_p]
        self._lib.cudaMemcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.c_int]
        self._lib.cudaSetDevice.argtypes = [ctypes.c_int]
        self._lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                              ctypes.c_int, ctypes.c_void_p]
        self._lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        self._lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self._lib.cudaFree.argtypes = [ctypes.c_void_p]
        self._local = threading.local()  # .scratch: this thread's ThreadScratch

    @classmethod
    def load(cls) -> CudaRuntime | None:
        """Return the runtime when a CUDA runtime library can be loaded, else None."""
        torch = sys.modules.get("torch")
        if torch is not None and not torch.cuda.is_available():
            return None
        # the runtime this process already runs (torch's) comes first: a second copy of
        # libcudart would keep its own state
        names = [*_mapped_libraries("libcudart.so"), "libcudart.so.13", "libcudart.so.12",
                 "libcudart.so.11.0", "libcudart.so"]
        # pip CUDA builds of torch ship the runtime in the nvidia-cuda-runtime package
        try:
            spec = importlib.util.find_spec("nvidia.cuda_runtime")
        except ImportError:
            spec = None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            names += sorted(str(p) for p in Path(folder, "lib").glob("libcudart.so*"))
        for name in names:
            try:
                return cls(ctypes.CDLL(name))
            except OSError:
                continue
        return None

    def locate(self, address: int) -> int | None:
        attrs = _CudaPointerAttributes()
        if self._lib.cudaPointerGetAttributes(ctypes.byref(attrs), ctypes.c_void_p(address)) != 0:
            self._lib.cudaGetLastError()  # clear the sticky error of an unknown pointer
            return None
        return attrs.device if attrs.type in (_CUDA_DEVICE, _CUDA_MANAGED) else None

    def _check(self, err: int, call: str) -> None:
        if err != 0:
            self._lib.cudaGetLastError()
            raise KVPoolError(Status.TRANSFER_FAILED, f"{call} failed with CUDA error {err}")

    def _copy(self, dst: int, src: int, size_bytes: int, kind: int) -> None:
        self._check(self._lib.cudaMemcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), size_bytes,
                                         kind), "cudaMemcpy")

    def _scratch(self, device: int, size_bytes: int) -> int | None:
        """This thread's device scratch of at least ``size_bytes``, or None when none can be
        allocated (the caller then copies range by range)."""
        scratch: ThreadScratch | None = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = ThreadScratch(self._free)
        address, have = scratch.by_device.get(device, (0, 0))
        if have >= size_bytes:
            return address
        if address:
            del scratch.by_device[device]
            self._free(address)
        pointer = ctypes.c_void_p()
        if self._lib.cudaMalloc(ctypes.byref(pointer), size_bytes) != 0 or not pointer.value:
            self._lib.cudaGetLastError()  # out of device memory: not sticky, just say no
            return None
        scratch.by_device[device] = (pointer.value, size_bytes)
        return pointer.value

    def _free(self, address: int) -> None:
        self._lib.cudaFree(ctypes.c_void_p(address))

    def _batches(self, device: int, ranges: Sequence[tuple[int, int]]
                 ) -> list[tuple[int | None, list[tuple[int, int, int]]]]:
        """Split ``ranges`` into (scratch address or None, [(offset in host buffer, address,
        size)]) batches: None batches are copied range by range."""
        small_bytes = sum(size for _, size in ranges if size < CUDA_DIRECT_MIN_BYTES)
        scratch = None
        if small_bytes and len(ranges) > 1:
            scratch = self._scratch(device, min(small_bytes, CUDA_SCRATCH_MAX_BYTES))
        direct: list[tuple[int, int, int]] = []
        batches: list[tuple[int | None, list[tuple[int, int, int]]]] = []
        batch: list[tuple[int, int, int]] = []
        batch_bytes, offset = 0, 0
        for address, size in ranges:
            # a batch covers one run of the host buffer: a direct range or a full scratch
            # ends it
            if batch and (scratch is None or size >= CUDA_DIRECT_MIN_BYTES
                          or batch_bytes + size > CUDA_SCRATCH_MAX_BYTES):
                batches.append((scratch, batch))
                batch, batch_bytes = [], 0
            if scratch is None or size >= CUDA_DIRECT_MIN_BYTES:
                direct.append((offset, address, size))
            else:
                batch.append((offset, address, size))
                batch_bytes += size
            offset += size
        if batch:
            batches.append((scratch, batch))
        return [(None, direct), *batches] if direct else batches

    def to_host(self, handle: int, dst: memoryview, src_ranges: Sequence[tuple[int, int]]
                ) -> None:
        self._check(self._lib.cudaSetDevice(handle), f"cudaSetDevice({handle})")
        host = buffer_address(dst)
        for scratch, batch in self._batches(handle, src_ranges):
            if scratch is None:
                for offset, address, size in batch:
                    self._copy(host + offset, address, size, _CUDA_D2H)
                continue
            cursor = scratch
            for _, address, size in batch:
                self._check(self._lib.cudaMemcpyAsync(ctypes.c_void_p(cursor),
                                                      ctypes.c_void_p(address), size, _CUDA_D2D,
                                                      None), "cudaMemcpyAsync")
                cursor += size
            # ordered after the gathers on the same (legacy default) stream; returns when done
            self._copy(host + batch[0][0], scratch, cursor - scratch, _CUDA_D2H)

    def from_host(self, handle: int, src: memoryview, dst_ranges: Sequence[tuple[int, int]]
                  ) -> None:
        self._check(self._lib.cudaSetDevice(handle), f"cudaSetDevice({handle})")
        host = buffer_address(src)
        for scratch, batch in self._batches(handle, dst_ranges):
            if scratch is None:
                for offset, address, size in batch:
                    self._copy(address, host + offset, size, _CUDA_H2D)
                continue
            batch_bytes = sum(size for _, _, size in batch)
            self._copy(scratch, host + batch[0][0], batch_bytes, _CUDA_H2D)
            cursor = scratch
            for _, address, size in batch:
                self._check(self._lib.cudaMemcpyAsync(ctypes.c_void_p(address),
                                                      ctypes.c_void_p(cursor), size, _CUDA_D2D,
                                                      None), "cudaMemcpyAsync")
                cursor += size
            # the bytes are in place, and the scratch free for the next call, on return
            self._check(self._lib.cudaStreamSynchronize(None), "cudaStreamSynchronize")


_ACL_H2D, _ACL_D2H = 1, 2


class AclRuntime:
    """Ascend NPU memory through CANN's Python ACL module (``acl``).

    ACL copies need a current context on the calling thread; the context current when the
    pointer was registered (the worker's device) is made current again before each copy.
    """

    name = "npu"

    def __init__(self, acl: Any) -> None:
        self._acl = acl

    @classmethod
    def load(cls) -> AclRuntime | None:
        """Return the runtime when CANN's ``acl`` module imports, else None."""
        if "torch_npu" not in sys.modules:
            with contextlib.suppress(ImportError):
                importlib.import_module("torch_npu")  # sets up the device context ACL uses
        try:
            return cls(importlib.import_module("acl"))
        except ImportError:
            return None

    def locate(self, address: int) -> Any | None:
        # NOTE: pyACL has no portable pointer query; a pointer that is not host memory of this
        # process is taken to be NPU memory of the current context once ACL is present.
        context, ret = self._acl.rt.get_context()
        return context if ret == 0 else None

    def _copy(self, context: Any, dst: int, src: int, size_bytes: int, kind: int) -> None:
        if self._acl.rt.set_context(context) != 0:
            raise KVPoolError(Status.TRANSFER_FAILED, "aclrtSetCurrentContext failed")
        ret = self._acl.rt.memcpy(dst, size_bytes, src, size_bytes, kind)
        if ret != 0:
            raise KVPoolError(Status.TRANSFER_FAILED, f"aclrtMemcpy failed with error {ret}")

    def to_host(self, handle: Any, dst: memoryview, src_ranges: Sequence[tuple[int, int]]
                ) -> None:
        host = buffer_address(dst)
        for address, size in src_ranges:
            self._copy(handle, host, address, size, _ACL_D2H)
            host += size

    def from_host(self, handle: Any, src: memoryview, dst_ranges: Sequence[tuple[int, int]]
                  ) -> None:
        host = buffer_address(src)
        for address, size in dst_ranges:
            self._copy(handle, address, host, size, _ACL_H2D)
            host += size


_runtimes: list[DeviceRuntime] | None = None


def default_runtimes() -> list[DeviceRuntime]:
    """Return the device runtimes present in this process, loading them on first use."""
    global _runtimes
    if _runtimes is None:
        found: list[DeviceRuntime] = []
        for loader in (CudaRuntime.load, AclRuntime.load):
            runtime = loader()
            if runtime is not None:
                found.append(runtime)
        _runtimes = found
    return _runtimes


def locate_device(address: int, size_bytes: int,
                  runtimes: list[DeviceRuntime]) -> DeviceMemory:
    """Return the device memory ``address`` lies in.

    Raises ``INVALID_ARGUMENT`` naming what is missing when no runtime claims the pointer.
    """
    for runtime in runtimes:
        handle = runtime.locate(address)
        if handle is not None:
            return DeviceMemory(runtime, handle)
    present = ", ".join(r.name for r in runtimes) or "none"
    raise KVPoolError(
        Status.INVALID_ARGUMENT,
        f"pointer 0x{address:x} ({size_bytes} bytes) is not readable host memory of this "
        f"process and no device runtime claims it (device runtimes present: {present}). "
        "CUDA memory needs torch built with CUDA (libcudart); Ascend NPU memory needs CANN's "
        "ACL runtime (the 'acl' Python module from CANN, with torch_npu).")

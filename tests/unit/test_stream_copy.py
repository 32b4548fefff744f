"""Large copies with streaming stores (``kvpool_client.transfer._ntcopy``, the optional C
extension that ``pip install`` builds where a C compiler is at hand) and the copy path that
uses them: byte-exact at every length and alignment, refusals that write nothing, and the
same bytes as the numpy path it replaces."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from kvpool_client.transfer import copy as copy_module

try:
    from kvpool_client.transfer import _ntcopy as ntcopy
except ImportError:  # pragma: no cover - see the last test
    ntcopy = None

built = pytest.mark.skipif(ntcopy is None, reason="the C extension was not built here")


def _random(size: int, seed: int) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8))


@built
@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 63, 64, 65, 127, 4096, (256 << 10) + 7])
def test_every_length_and_alignment_is_copied_exactly(size: int) -> None:
    for dst_shift in (0, 1, 7, 15, 16, 33):
        for src_shift in (0, 3, 16):
            src = _random(size + src_shift, seed=size + src_shift)
            dst = bytearray(b"\xee" * (size + dst_shift + 64))
            ntcopy.copy(memoryview(dst)[dst_shift:dst_shift + size],
                        memoryview(src)[src_shift:src_shift + size])
            assert dst[dst_shift:dst_shift + size] == src[src_shift:src_shift + size]
            # nothing outside the destination range was touched
            assert dst[:dst_shift] == b"\xee" * dst_shift
            assert dst[dst_shift + size:] == b"\xee" * 64


@built
def test_refusals_write_nothing() -> None:
    dst = bytearray(b"\x00" * 100)
    with pytest.raises(ValueError, match="destination holds 100 bytes, source 99"):
        ntcopy.copy(dst, bytes(99))
    with pytest.raises(TypeError):
        ntcopy.copy(b"\x00" * 100, bytes(100))  # read-only destination
    with pytest.raises(TypeError):
        ntcopy.copy(memoryview(bytearray(200))[::2], bytes(100))  # not contiguous
    assert dst == b"\x00" * 100


@built
def test_overlapping_ranges_copy_like_memmove() -> None:
    data = _random(1 << 20, seed=1)
    expected = bytes(data[:(1 << 20) - 4096])
    view = memoryview(data)
    ntcopy.copy(view[4096:], view[:(1 << 20) - 4096])
    assert bytes(data[4096:]) == expected


@built
def test_the_copy_path_streams_large_pieces_and_matches_numpy(monkeypatch) -> None:
    pieces = [(1 << 20) + 5, 300 << 10, 64 << 10, 7]
    sources = [_random(size, seed=size) for size in pieces]
    streamed = [bytearray(size) for size in pieces]
    copy_module.copy_nogil([(memoryview(d), memoryview(s))
                            for d, s in zip(streamed, sources, strict=True)])
    calls: list[int] = []
    real = copy_module._stream_copy
    assert real is not None
    monkeypatch.setattr(copy_module, "_stream_copy",
                        lambda dst, src: (calls.append(dst.nbytes), real(dst, src)))
    copy_module.copy_nogil([(memoryview(bytearray(size)), memoryview(src))
                            for size, src in zip(pieces, sources, strict=True)])
    assert calls == [size for size in pieces if size >= copy_module.STREAM_MIN_BYTES]
    monkeypatch.setattr(copy_module, "_stream_copy", None)  # as where it was not built
    plain = [bytearray(size) for size in pieces]
    copy_module.copy_nogil([(memoryview(d), memoryview(s))
                            for d, s in zip(plain, sources, strict=True)])
    assert streamed == plain == sources


def test_it_is_built_wherever_a_c_compiler_and_python_headers_are() -> None:
    """The package build makes it optional; the test environment has what it needs, so a
    silently failed build shows here rather than as a slow copy path."""
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers")
    assert ntcopy is not None, "kvpool_client.transfer._ntcopy was not built"
    assert copy_module._stream_copy is ntcopy.copy

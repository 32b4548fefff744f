"""Raw memory ranges of engine tensors, without importing torch.

Connectors receive torch tensors (CPU, CUDA or NPU) or numpy arrays. Each becomes the
``(address, nbytes)`` range it occupies, which a :class:`RegionRegistry` turns into host views or
device staging. Only contiguous tensors describe one range; anything else is refused.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvpool_client.compat.memory import PointerRange
from kvpool_wire.status import KVPoolError, Status


def pointer_range(tensor: Any) -> PointerRange:
    """Return ``(address, nbytes)`` of a contiguous torch tensor or numpy array.

    Raises ``INVALID_ARGUMENT`` for a non-contiguous tensor or an object that is neither.
    """
    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported
    if torch is not None and isinstance(tensor, torch.Tensor):
        if not tensor.is_contiguous():
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"tensor of shape {tuple(tensor.shape)} is not contiguous")
        return int(tensor.data_ptr()), int(tensor.numel()) * int(tensor.element_size())
    if isinstance(tensor, np.ndarray):
        if not tensor.flags["C_CONTIGUOUS"]:
            raise KVPoolError(Status.INVALID_ARGUMENT,
                              f"array of shape {tensor.shape} is not contiguous")
        return int(tensor.ctypes.data), int(tensor.nbytes)
    raise KVPoolError(Status.INVALID_ARGUMENT,
                      f"expected a torch tensor or numpy array, got {type(tensor).__name__}")


def flatten(tensors: Any) -> list[Any]:
    """Return the tensors of an arbitrarily nested list/tuple, in order (MindIE's layout)."""
    if isinstance(tensors, list | tuple):
        out: list[Any] = []
        for item in tensors:
            out.extend(flatten(item))
        return out
    return [tensors]


def pointer_ranges(tensors: Iterable[Any]) -> list[PointerRange]:
    """Return the ranges of every tensor of one object, in order."""
    return [pointer_range(t) for t in flatten(list(tensors))]

"""Mooncake 0.3.13's tensor calls: a torch tensor stored as one object (``tensor_format``: a
304-byte header, then its bytes), written and read through the bytes calls of the store.

Rules of this file:
- A put takes any torch tensor of a dtype Mooncake numbers (``tensor_format.DTYPES``) and at
  most eight dimensions, on any device (a device tensor is copied to host memory first, as
  Mooncake does), contiguous or not; anything else is -600 and stores nothing. The header and
  the bytes are written as one object from two regions: the tensor is not copied to build it.
- Per key the codes of the bytes calls: 0 (also for an existing key: kvpool's put is
  write-once), or a negative code. ``pub_*`` take a ``ReplicateConfig``; ``upsert_*`` replace.
- A get returns a tensor of the stored dtype and shape (a zero-dimensional one too; Mooncake
  0.3.13 returns it with shape ``(1,)``), or None when the key is missing or its bytes are not
  a tensor object. ``get_tensor`` / ``batch_get_tensor`` return tensors owning host memory;
  the ``*_into`` calls read the object into the registered buffer and return a tensor over
  its bytes there (no copy), None when the buffer is too small or not registered.
- ``*_with_tp`` split a tensor into ``tp_size`` equal shards along ``split_dim`` and store
  shard ``r`` under ``"{key}_tp_{r}"`` (a ``tp_size`` of 1 or less stores the whole tensor
  under ``key``); a dimension that does not split evenly is -600, as in Mooncake. Gets read
  the shard of ``tp_rank``.
- torch is imported on first use: the store works without it, and these calls then answer
  -600 (puts) or None (gets) with the reason logged.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvpool_client.compat import codes
from kvpool_client.compat.replicate import ReplicateConfig
from kvpool_client.compat.tensor_format import HEADER_BYTES, Shard, TensorHeader, decode, encode
from kvpool_wire.status import KVPoolError

logger = logging.getLogger(__name__)

#: One object to write: its regions (header, then the tensor's bytes), or the code refusing it.
_Object = list[memoryview] | int


def _torch() -> Any:
    import torch

    return torch


def _host_contiguous(tensor: Any) -> Any:
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch tensor, got {type(tensor).__name__}")
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    # a lazily negated or conjugated view shares its storage's unresolved bytes
    return host.resolve_neg().resolve_conj().contiguous()


def _object(tensor: Any, shard: Shard | None = None,
            global_shape: tuple[int, ...] | None = None) -> list[memoryview]:
    """The regions of ``tensor``'s object. Raises ValueError for what cannot be stored."""
    torch = _torch()
    host = _host_contiguous(tensor)
    data = host.reshape(-1).view(torch.uint8).numpy()
    return [memoryview(_header(host, shard, global_shape)), memoryview(data).cast("B")]


def _header(tensor: Any, shard: Shard | None = None,
            global_shape: tuple[int, ...] | None = None) -> bytes:
    """The header of ``tensor``'s object (a shard of a tensor of ``global_shape``). Raises
    ValueError for a dtype or a rank a tensor object cannot hold."""
    shape = tuple(tensor.shape)
    return encode(TensorHeader(str(tensor.dtype).removeprefix("torch."), shape,
                               global_shape if global_shape is not None else shape, shard))


def _shards(tensor: Any, tp_size: int, split_dim: int) -> list[list[memoryview]]:
    """The objects of the ``tp_size`` shards of ``tensor``. Raises ValueError when it does not
    split evenly along ``split_dim``."""
    host = _host_contiguous(tensor)
    if not 0 <= split_dim < host.dim():
        raise ValueError(f"split_dim {split_dim} is not a dimension of a {host.dim()}-d tensor")
    size = host.shape[split_dim]
    if size % tp_size:
        raise ValueError(f"dimension {split_dim} of size {size} does not split into {tp_size}")
    step = size // tp_size
    whole = tuple(host.shape)
    return [_object(host.narrow(split_dim, rank * step, step), Shard(rank, tp_size, split_dim),
                    whole) for rank in range(tp_size)]


def _tensor_over(view: memoryview | bytearray, header: TensorHeader) -> Any:
    """A tensor of ``header``'s dtype and shape over the bytes after the header in ``view``
    (sharing them)."""
    torch = _torch()
    dtype = getattr(torch, header.dtype)
    if header.data_bytes == 0:
        return torch.empty(header.shape, dtype=dtype)
    flat = torch.frombuffer(view, dtype=torch.uint8, count=header.data_bytes,
                            offset=HEADER_BYTES)
    return flat.view(dtype).reshape(header.shape)


def serialize_tensor(tensor: Any) -> tuple[bytes, int, int, Any]:
    """``mooncake.store._serialize_tensor``: the header of ``tensor``'s object, the address
    and length of its bytes, and the tensor that owns them (keep it alive while the address is
    used). A non-contiguous tensor is made contiguous (a copy); a device tensor stays on its
    device, so the address is a device address, as in Mooncake. Raises ValueError for what a
    tensor object cannot hold."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"expected a torch tensor, got {type(tensor).__name__}")
    owner = tensor.detach().resolve_neg().resolve_conj().contiguous()
    return _header(owner), owner.data_ptr(), owner.numel() * owner.element_size(), owner


def tensor_metadata_size() -> int:
    """``mooncake.store._tensor_metadata_size``: the bytes of a tensor object's header."""
    return HEADER_BYTES


def deserialize_tensor(payload: bytes | bytearray | memoryview) -> Any:
    """``mooncake.store._deserialize_tensor``: the tensor of a whole tensor object (header,
    then bytes), in host memory of its own. Raises ValueError when ``payload`` is not one."""
    data = bytearray(payload)
    header = decode(data, len(data))
    if header is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return _tensor_over(data, header)


class StoreTensors:
    """Mixed into ``MooncakeDistributedStore`` (which provides ``_write_objects``,
    ``_put_ranges``, ``batch_get_buffer``, ``batch_get_into``, ``_replacing`` and
    ``_registry``)."""

    # --- puts ---

    def put_tensor(self, key: str, tensor: Any) -> int:
        """Store ``tensor`` under ``key``; 0 or a negative code."""
        return self.batch_put_tensor([key], [tensor])[0]

    def batch_put_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        """0 / negative code per key."""
        return self._put_tensors("batch_put_tensor", keys, tensors_list, None, replace=False)

    def pub_tensor(self, key: str, tensor: Any, config: ReplicateConfig | None = None) -> int:
        """``put_tensor`` with a ``ReplicateConfig``."""
        return self.batch_pub_tensor([key], [tensor], config)[0]

    def batch_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                         config: ReplicateConfig | None = None) -> list[int]:
        """``batch_put_tensor`` with a ``ReplicateConfig``."""
        return self._put_tensors("batch_pub_tensor", keys, tensors_list, config, replace=False)

    def upsert_tensor(self, key: str, tensor: Any) -> int:
        """Store ``tensor`` under ``key``, replacing an existing object."""
        return self.batch_upsert_tensor([key], [tensor])[0]

    def batch_upsert_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any]) -> list[int]:
        """0 / negative code per key."""
        return self._put_tensors("batch_upsert_tensor", keys, tensors_list, None, replace=True)

    def upsert_pub_tensor(self, key: str, tensor: Any,
                          config: ReplicateConfig | None = None) -> int:
        """``upsert_tensor`` with a ``ReplicateConfig``."""
        return self.batch_upsert_pub_tensor([key], [tensor], config)[0]

    def batch_upsert_pub_tensor(self, keys: Sequence[str], tensors_list: Sequence[Any],
                                config: ReplicateConfig | None = None) -> list[int]:
        """``batch_upsert_tensor`` with a ``ReplicateConfig``."""
        return self._put_tensors("batch_upsert_pub_tensor", keys, tensors_list, config,
                                 replace=True)

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """Store the tensor object of ``size`` bytes at ``buffer_ptr`` (registered memory, as
        ``get_tensor_into`` left it); -600 when those bytes are not a tensor object."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_put_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[int]:
        """0 / negative code per key."""
        return self._put_tensor_objects("batch_put_tensor_from", keys, buffer_ptrs, sizes,
                                        replace=False)

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int) -> int:
        """``put_tensor_from``, replacing an existing object."""
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size])[0]

    def batch_upsert_tensor_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                                 sizes: Sequence[int]) -> list[int]:
        """0 / negative code per key."""
        return self._put_tensor_objects("batch_upsert_tensor_from", keys, buffer_ptrs, sizes,
                                        replace=True)

    # --- tensor-parallel shards ---

    def put_tensor_with_tp(self, key: str, tensor: Any, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> int:
        """Store the ``tp_size`` shards of ``tensor``; 0 or the first failing code."""
        return self.batch_put_tensor_with_tp([key], [tensor], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 tp_rank: int = 0, tp_size: int = 1,
                                 split_dim: int = 0) -> list[int]:
        """0 / first failing code per base key."""
        return self._put_shards("batch_put_tensor_with_tp", base_keys, tensors_list, None,
                                tp_size, split_dim)

    def pub_tensor_with_tp(self, key: str, tensor: Any, config: ReplicateConfig | None = None,
                           tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> int:
        """``put_tensor_with_tp`` with a ``ReplicateConfig``."""
        return self.batch_pub_tensor_with_tp([key], [tensor], config, tp_rank, tp_size,
                                             split_dim)[0]

    def batch_pub_tensor_with_tp(self, base_keys: Sequence[str], tensors_list: Sequence[Any],
                                 config: ReplicateConfig | None = None, tp_rank: int = 0,
                                 tp_size: int = 1, split_dim: int = 0) -> list[int]:
        """``batch_put_tensor_with_tp`` with a ``ReplicateConfig``."""
        return self._put_shards("batch_pub_tensor_with_tp", base_keys, tensors_list, config,
                                tp_size, split_dim)

    def put_tensor_with_tp_from(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> int:
        """Store the shards of the tensor object at ``buffer_ptr``; 0 or a code."""
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank,
                                                  tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1,
                                      split_dim: int = 0) -> list[int]:
        """0 / first failing code per base key."""
        if not len(base_keys) == len(buffer_ptrs) == len(sizes):
            return [codes.INVALID_PARAMS] * len(base_keys)
        tensors = [self._tensor_at(ptr, size) for ptr, size in
                   zip(buffer_ptrs, sizes, strict=True)]
        return self._put_shards("batch_put_tensor_with_tp_from", base_keys, tensors, None,
                                tp_size, split_dim)

    # --- gets ---

    def get_tensor(self, key: str) -> Any:
        """The tensor stored under ``key``, or None."""
        return self.batch_get_tensor([key])[0]

    def batch_get_tensor(self, keys: Sequence[str]) -> list[Any]:
        """A tensor or None per key."""
        handles = self.batch_get_buffer(keys)  # type: ignore[attr-defined]
        out: list[Any] = []
        for key, handle in zip(keys, handles, strict=True):
            header = decode(handle, len(handle)) if handle is not None else None
            out.append(self._tensor_or_none(key, header, handle))
        return out

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> Any:
        """Read ``key``'s object into the registered buffer; a tensor over it there, or None."""
        return self.batch_get_tensor_into([key], [buffer_ptr], [size])[0]

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int],
                              sizes: Sequence[int]) -> list[Any]:
        """A tensor (over its buffer) or None per key; -600 per key for lists of unequal
        lengths, as Mooncake."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [codes.INVALID_PARAMS] * len(keys)
        read = self.batch_get_into(keys, buffer_ptrs, sizes)  # type: ignore[attr-defined]
        out: list[Any] = []
        for key, ptr, nbytes in zip(keys, buffer_ptrs, read, strict=True):
            if nbytes < 0:
                out.append(None)
                continue
            view = self._host_view(ptr, nbytes)
            if view is None:
                logger.error("get tensor %s: the buffer is device memory; a tensor over it "
                             "needs get_tensor_into_cuda, which kvpool does not have", key)
                out.append(None)
                continue
            out.append(self._tensor_or_none(key, decode(view, nbytes), view))
        return out

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1,
                           split_dim: int = 0) -> Any:
        """The shard of ``tp_rank`` (the whole tensor for a ``tp_size`` of 1), or None."""
        return self.get_tensor(_shard_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(self, base_keys: Sequence[str], tp_rank: int = 0,
                                 tp_size: int = 1) -> list[Any]:
        """The shard of ``tp_rank`` per base key, or None."""
        return self.batch_get_tensor([_shard_key(k, tp_rank, tp_size) for k in base_keys])

    def get_tensor_with_tp_into(self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0,
                                tp_size: int = 1, split_dim: int = 0) -> Any:
        """``get_tensor_into`` of the shard of ``tp_rank``."""
        return self.get_tensor_into(_shard_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys: Sequence[str],
                                      buffer_ptrs: Sequence[int], sizes: Sequence[int],
                                      tp_rank: int = 0, tp_size: int = 1) -> list[Any]:
        """``batch_get_tensor_into`` of the shards of ``tp_rank``."""
        return self.batch_get_tensor_into([_shard_key(k, tp_rank, tp_size) for k in base_keys],
                                          buffer_ptrs, sizes)

    # --- helpers ---

    def _put_tensors(self, op: str, keys: Sequence[str], tensors: Sequence[Any],
                     config: ReplicateConfig | None, *, replace: bool) -> list[int]:
        if len(keys) != len(tensors):
            return [codes.INVALID_PARAMS] * len(keys)
        objects: list[_Object] = []
        for key, tensor in zip(keys, tensors, strict=True):
            objects.append(_refused(op, key, lambda t=tensor: _object(t)))
        written: list[int] = self._write_objects(  # type: ignore[attr-defined]
            op, keys, objects, config, replace=replace)
        return written

    def _put_shards(self, op: str, base_keys: Sequence[str], tensors: Sequence[Any],
                    config: ReplicateConfig | None, tp_size: int, split_dim: int) -> list[int]:
        if len(base_keys) != len(tensors):
            return [codes.INVALID_PARAMS] * len(base_keys)
        if tp_size <= 1:
            return self._put_tensors(op, base_keys, tensors, config, replace=False)
        keys: list[str] = []
        objects: list[_Object] = []
        owners: list[int] = []  # per shard: the index of its base key
        results = [codes.OK] * len(base_keys)
        for index, (key, tensor) in enumerate(zip(base_keys, tensors, strict=True)):
            shards = _refused(op, key, lambda t=tensor: _shards(t, tp_size, split_dim))
            if isinstance(shards, int):
                results[index] = shards
                continue
            keys += [_shard_key(key, rank, tp_size) for rank in range(tp_size)]
            objects += shards
            owners += [index] * tp_size
        written = self._write_objects(  # type: ignore[attr-defined]
            op, keys, objects, config, replace=False)
        for index, code in zip(owners, written, strict=True):
            if results[index] == codes.OK:
                results[index] = code
        return results

    def _put_tensor_objects(self, op: str, keys: Sequence[str], buffer_ptrs: Sequence[int],
                            sizes: Sequence[int], *, replace: bool) -> list[int]:
        """Write tensor objects lying in registered memory, each checked to be one first."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [codes.INVALID_PARAMS] * len(keys)
        results = [codes.OK] * len(keys)
        wanted: list[int] = []
        for index, (key, ptr, size) in enumerate(zip(keys, buffer_ptrs, sizes, strict=True)):
            if self._header_at(ptr, size) is None:
                logger.error("%s %s: %d bytes at %#x are not a tensor object in registered "
                             "memory", op, key, size, ptr)
                results[index] = codes.INVALID_PARAMS
            else:
                wanted.append(index)
        wanted_keys = [keys[i] for i in wanted]
        refused = self._replacing(  # type: ignore[attr-defined]
            wanted_keys, None) if replace and wanted else None
        written = [refused] * len(wanted) if refused is not None else \
            self._put_ranges(op, wanted_keys,  # type: ignore[attr-defined]
                             [[(buffer_ptrs[i], sizes[i])] for i in wanted], None)
        for index, code in zip(wanted, written, strict=True):
            results[index] = code
        return results

    def _header_at(self, ptr: int, size: int) -> TensorHeader | None:
        """The header of the tensor object of ``size`` bytes at ``ptr`` in registered memory,
        or None (not registered, or not a tensor object)."""
        if size < HEADER_BYTES:
            return None
        head = bytearray(HEADER_BYTES)
        try:
            self._registry.find(ptr, size)  # type: ignore[attr-defined]
            self._registry.read_into(ptr, memoryview(head))  # type: ignore[attr-defined]
        except KVPoolError:
            return None
        return decode(head, size)

    def _host_view(self, ptr: int, size: int) -> memoryview | None:
        """The registered host memory ``[ptr, ptr + size)``, or None (not registered, or
        device memory)."""
        try:
            region = self._registry.find(ptr, size)  # type: ignore[attr-defined]
        except KVPoolError:
            return None
        return region.host_view(ptr, size)  # type: ignore[no-any-return]

    def _tensor_at(self, ptr: int, size: int) -> Any:
        """The tensor whose object lies at ``ptr`` in registered host memory, or None."""
        view = self._host_view(ptr, size)
        if view is None:
            return None
        header = decode(view, size)
        return None if header is None else _tensor_over(view, header)

    @staticmethod
    def _tensor_or_none(key: str, header: TensorHeader | None, data: Any) -> Any:
        if data is None:
            return None
        if header is None:
            logger.error("get tensor %s: the object is not a tensor object", key)
            return None
        try:
            return _tensor_over(data, header)
        except ImportError as exc:
            logger.error("get tensor %s: %s", key, exc)
            return None


def _shard_key(key: str, tp_rank: int, tp_size: int) -> str:
    return key if tp_size <= 1 else f"{key}_tp_{tp_rank}"


def _refused(op: str, key: str, build: Any) -> Any:
    """``build()``, or -600 (logged) when it raises ValueError or torch is missing."""
    try:
        return build()
    except (ValueError, TypeError, ImportError, RuntimeError) as exc:
        logger.error("%s %s: %s", op, key, exc)
        return codes.INVALID_PARAMS

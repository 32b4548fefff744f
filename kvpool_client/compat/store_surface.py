"""The names of ``mooncake.store`` (Mooncake Store's client classes), backed by kvpool.

It is the module ``mooncake.store`` of both drop-ins: ``kvpool-mooncake`` (the whole
``mooncake`` package, where Mooncake's wheel is not installed) re-exports it, and
``kvpool-mooncake-store`` (beside Mooncake's wheel) loads it under that name.
"""

from kvpool_client.compat.host_memory import (
    BufferLease,
    BufferPool,
    MooncakeHostMemAllocator,
    get_alloc_func_addr,
    get_free_func_addr,
)
from kvpool_client.compat.mooncake import (
    BufferHandle,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
from kvpool_client.compat.store_types import ENUM_MEMBERS as _ENUM_MEMBERS
from kvpool_client.compat.store_types import (
    BufferLeaseView,
    Descriptor,
    DiskDescriptor,
    EngramStore,
    EngramStoreConfig,
    MemoryDescriptor,
    MooncakeDistributedNoFRegister,
    ObjectDataType,
    ParallelAxis,
    QueryTaskResponse,
    ReadTarget,
    ReplicaDescriptor,
    ReplicaStatus,
    TaskStatus,
    TaskType,
    TensorParallelism,
    bind_to_numa_node,
)
from kvpool_client.compat.tensor_calls import deserialize_tensor as _deserialize_tensor
from kvpool_client.compat.tensor_calls import serialize_tensor as _serialize_tensor
from kvpool_client.compat.tensor_calls import tensor_metadata_size as _tensor_metadata_size

# Mooncake's aliases: its pool leases registered memory, as this one does
RegisteredBufferPool, RegisteredBufferLease = BufferPool, BufferLease
RegisteredBufferLeaseView = BufferLeaseView

globals().update(_ENUM_MEMBERS)  # Mooncake exports every enum member by name too

__all__ = [
    "BufferHandle", "BufferLease", "BufferLeaseView", "BufferPool", "Descriptor",
    "DiskDescriptor", "EngramStore", "EngramStoreConfig", "MemoryDescriptor",
    "MooncakeDistributedNoFRegister", "MooncakeDistributedStore", "MooncakeHostMemAllocator",
    "ObjectDataType", "ParallelAxis", "QueryTaskResponse", "ReadTarget", "RegisteredBufferLease",
    "RegisteredBufferLeaseView", "RegisteredBufferPool", "ReplicaDescriptor", "ReplicaStatus",
    "ReplicateConfig", "SoftPinAction", "TaskStatus", "TaskType", "TensorParallelism",
    "bind_to_numa_node", "get_alloc_func_addr", "get_free_func_addr", *_ENUM_MEMBERS,
    # the tensor codec of Mooncake's wheel modules (structured_object_store)
    "_deserialize_tensor", "_serialize_tensor", "_tensor_metadata_size",
]

BACKEND = "kvpool"

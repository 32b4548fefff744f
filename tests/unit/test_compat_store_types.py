"""The enums and small types ``mooncake.store`` binds beside its store class: Mooncake's names,
numbers, fields and defaults; wrong types refused as the binding refuses them; features kvpool
does not have refused at construction with a clear error."""

from __future__ import annotations

import os

import pytest

from kvpool_client.compat import store_types as t
from kvpool_client.compat.replicate import ReplicateConfig


def test_enums_carry_mooncakes_numbers_and_the_later_enum_owns_a_shared_name() -> None:
    assert [int(m) for m in t.ObjectDataType] == list(range(10))
    assert t.ObjectDataType.KVCACHE == 1 and t.ObjectDataType.GENERAL == 9
    assert (t.ReplicaStatus.COMPLETE, t.ReplicaStatus.FAILED) == (3, 5)
    assert (t.TaskStatus.FAILED, t.TaskStatus.SUCCESS) == (2, 3)
    assert t.ENUM_MEMBERS["FAILED"] is t.TaskStatus.FAILED  # as Mooncake's module exports it
    assert t.ENUM_MEMBERS["COMPLETE"] is t.ReplicaStatus.COMPLETE
    assert t.ENUM_MEMBERS["REPLICA_MOVE"] is t.TaskType.REPLICA_MOVE


def test_value_types_have_mooncakes_defaults_and_check_their_fields() -> None:
    axis = t.ParallelAxis()
    assert (axis.kind, axis.rank, axis.size, axis.split_dim) == ("", 0, 1, None)
    axis.kind, axis.split_dim = "tp", 1
    with pytest.raises(TypeError):
        axis.kind = 1
    with pytest.raises(TypeError):
        axis.rank = True
    with pytest.raises(AttributeError):
        axis.knd = "tp"
    layout = t.TensorParallelism()
    layout.axes = [axis]
    assert t.TensorParallelism().axes == []  # defaults are not shared between instances
    target = t.ReadTarget()
    assert target.mode == "as_stored" and target.parallelism is None
    target.mode = "FULL"
    assert target.mode == "full"
    with pytest.raises(RuntimeError, match="Unsupported ReadTarget mode"):
        target.mode = "half"
    response = t.QueryTaskResponse()
    assert response.status is t.TaskStatus.PENDING and response.id == (0, 0)
    assert t.EngramStoreConfig().table_vocab_sizes == [1024]


def test_replicate_config_data_type_is_an_object_data_type() -> None:
    config = ReplicateConfig()
    assert config.data_type is t.ObjectDataType.UNKNOWN
    config.data_type = t.ObjectDataType.WEIGHT
    assert "data_type=<ObjectDataType.WEIGHT: 3>" in repr(config)
    with pytest.raises(TypeError):
        config.data_type = 3  # type: ignore[assignment]


def test_what_kvpool_lacks_refuses_construction() -> None:
    with pytest.raises(NotImplementedError, match="not supported by kvpool"):
        t.EngramStore(0, t.EngramStoreConfig())
    with pytest.raises(TypeError, match="No constructor defined"):
        t.ReplicaDescriptor()


def test_bind_to_numa_node_pins_the_thread_to_the_nodes_cpus() -> None:
    before = os.sched_getaffinity(0)
    try:
        if os.path.exists("/sys/devices/system/node/node0"):
            with open("/sys/devices/system/node/node0/cpulist", encoding="ascii") as f:
                node0: set[int] = set()
                for part in f.read().strip().split(","):
                    low, _, high = part.partition("-")
                    node0.update(range(int(low), int(high or low) + 1))
            os.sched_setaffinity(0, {max(before)})  # narrowed first: the bind must change it
            t.bind_to_numa_node(0)
            assert os.sched_getaffinity(0) == node0 & before
        with pytest.raises(ValueError, match="NUMA node 4095"):
            t.bind_to_numa_node(4095)
    finally:
        os.sched_setaffinity(0, before)

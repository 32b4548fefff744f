"""A client's data server on the port, or in the port range, its config names (``data_port``):
what a firewall between workers lets through. Real master, real clients, 127.0.0.1."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import free_ports

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire.status import KVPoolError, Status


def make_config(master: Any, **changes: Any) -> ClientConfig:
    values: dict[str, Any] = {"master_server_address": master.address,
                              "global_segment_size": "16mb", "rpc_timeout_s": 5,
                              "transport": "tcp"}  # bytes between the two cross the port
    values.update(changes)
    return ClientConfig.from_dict(values)


def port_of(client: KVPoolClient) -> int:
    return int(client.hostname.rpartition(":")[2])


def test_clients_listen_in_the_range_and_fail_clearly_when_it_is_full(master: Any) -> None:
    first = free_ports(2)
    span = f"{first}-{first + 1}"
    with KVPoolClient(make_config(master, data_port=span)) as a, \
            KVPoolClient(make_config(master, data_port=span)) as b:
        assert {port_of(a), port_of(b)} == {first, first + 1}
        a.put("through-the-range", b"x" * 4096)
        assert b.get("through-the-range") == b"x" * 4096
        with pytest.raises(KVPoolError) as full:
            KVPoolClient(make_config(master, data_port=span))
        assert full.value.status == Status.INVALID_ARGUMENT
        assert f"ports {span} (data_port)" in full.value.message
    with KVPoolClient(make_config(master, data_port=first + 1)) as exact:
        assert port_of(exact) == first + 1

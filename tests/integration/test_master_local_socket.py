"""The lean framing on the master's abstract Unix socket, used by clients on its host.

Real master processes on 127.0.0.1; the socket is advertised at registration, checked by the
client (peer pid), never served with TLS, and switched off by ``--local-socket off``.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.rpc import MasterRpc, TlsConfig
from kvpool_client.rpc.endpoints import connect_local as _connect_local
from kvpool_wire._pb import kvpool_pb2 as pb


def _register(lean_socket: Any, master: Any) -> Any:
    conn = lean_socket(master.fast_port)
    request = pb.RegisterClientRequest(client_id="probe", host_id="h").SerializeToString()
    method, answer = conn.call(pb.METHOD_REGISTER_CLIENT, request)
    assert method == pb.METHOD_REGISTER_CLIENT
    return pb.RegisterClientResponse.FromString(answer)


def _client(master: Any) -> KVPoolClient:
    return KVPoolClient(ClientConfig.from_dict({"master_server_address": master.address,
                                                "global_segment_size": "16mb"}))


def test_clients_on_the_host_call_over_the_unix_socket(master: Any, lean_socket: Any) -> None:
    reply = _register(lean_socket, master)
    assert reply.fast_socket.startswith("kvpool-master-") and reply.master_pid == master.pid
    with _client(master) as client:
        client.put("over-unix", b"payload")
        assert client.get("over-unix") == b"payload"
        rpc = client.async_client.member.rpc
        name = b"\0" + reply.fast_socket.encode()
        # calls run on the loop, and single ops run on the calling thread: both connections
        assert rpc._legs[0]._lean._transport.get_extra_info("peername") == name
        assert client._path is not None  # the sync client's calls: the blocking stub's pool
        assert client._path.rpc._legs[0]._idle[0]._sock.getpeername() == name
        print(f"client's lean connections' peer: {name!r}")


def test_a_socket_served_by_another_process_is_not_used(master: Any, lean_socket: Any) -> None:
    reply = _register(lean_socket, master)
    assert _connect_local(reply.fast_socket, reply.master_pid + 1) is None  # wrong pid
    assert _connect_local("kvpool-master-absent", reply.master_pid) is None
    assert _connect_local("", reply.master_pid) is None
    sock = _connect_local(reply.fast_socket, reply.master_pid)
    assert isinstance(sock, socket.socket)
    sock.close()


def test_local_socket_off_keeps_clients_on_tcp(start_master: Any, lean_socket: Any) -> None:
    master = start_master("--local-socket", "off")
    reply = _register(lean_socket, master)
    assert reply.fast_socket == "" and reply.master_pid == 0
    with _client(master) as client:
        client.put("over-tcp", b"payload")
        assert client.get("over-tcp") == b"payload"
        lean = client.async_client.member.rpc._legs[0]._lean
        assert lean._transport.get_extra_info("peername") == ("127.0.0.1", master.fast_port)
        assert client._path is not None
        pool = client._path.rpc._legs[0]._idle
        assert pool[0]._sock.getpeername() == ("127.0.0.1", master.fast_port)


async def test_no_unix_socket_is_served_with_tls(start_master: Any, pki: dict[str, str]) -> None:
    # A Unix socket would let local processes skip the client-certificate check.
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"])
    rpc = MasterRpc(master.address, tls=TlsConfig(ca_path=pki["ca.crt"]))
    try:
        await rpc.register_client("t", "h", "")
        assert rpc._legs[0]._fast_socket == ""
    finally:
        await rpc.close()


@pytest.mark.parametrize("value", ["maybe", ""])
def test_a_bad_local_socket_value_is_refused(start_master: Any, value: str) -> None:
    with pytest.raises(RuntimeError, match="local.socket"):
        start_master("--local-socket", value, timeout_s=10)

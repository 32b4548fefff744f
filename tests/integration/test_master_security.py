"""TLS, mutual TLS and the shared-secret token on both master ports; refusals are counted."""

from __future__ import annotations

import shutil
import ssl
import urllib.request

import pytest

from kvpool_client.rpc import MasterRpc, TlsConfig
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire.status import KVPoolError, Status

TOKEN = "s3cret-token-for-tests"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")




def _metric_lines(metrics_url: str, prefix: str) -> str:
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=10) as response:
        return "\n".join(line for line in response.read().decode().splitlines()
                         if line.startswith(prefix))


async def _round_trip(rpc: MasterRpc, client_id: str, metrics_url: str) -> None:
    registration = await rpc.register_client(client_id, "h", "")
    assert rpc.fast_port == registration.fast_port > 0
    statuses, _ = await rpc.exist(client_id, [b"a"])
    assert statuses == [Status.NOT_FOUND]
    assert await rpc.heartbeat(client_id) == Status.OK
    # Both calls went over the lean port (no silent fallback to gRPC).
    served = _metric_lines(metrics_url, "kvpool_rpc_requests_total")
    assert 'method="Exist",transport="lean"} 1.0' in served
    assert 'method="Heartbeat",transport="lean"} 1.0' in served


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["lean", "grpc"])
async def test_tls_works_and_plaintext_is_refused(start_master, pki, use_fast_path) -> None:
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"])
    rpc = MasterRpc(master.address, tls=TlsConfig(ca_path=pki["ca.crt"]),
                    use_fast_path=use_fast_path)
    try:
        await rpc.register_client("t", "h", "")
        statuses, _ = await rpc.exist("t", [b"a"])
        assert statuses == [Status.NOT_FOUND]
        transport = "lean" if use_fast_path else "grpc"
        assert f'method="Exist",transport="{transport}"}} 1.0' in _metric_lines(
            master.metrics_url, "kvpool_rpc_requests_total")
    finally:
        await rpc.close()
    plain = MasterRpc(master.address, timeout_s=2.0)
    try:
        with pytest.raises(KVPoolError) as err:
            await plain.register_client("p", "h", "")
        assert err.value.status in (Status.RPC_FAILED, Status.TIMEOUT)
    finally:
        await plain.close()


def test_plaintext_frames_to_a_tls_lean_port_are_refused(start_master, pki, lean_socket) -> None:
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"])
    conn = lean_socket(master.fast_port)
    with pytest.raises((ConnectionError, OSError)):
        conn.call(pb.METHOD_EXIST, pb.ExistRequest(keys=[b"a"]).SerializeToString())
    context = ssl.create_default_context(cafile=pki["ca.crt"])
    secure = lean_socket(master.fast_port, ssl_context=context)
    method, payload = secure.call(pb.METHOD_EXIST, pb.ExistRequest(keys=[b"a"])
                                  .SerializeToString())
    assert method == pb.METHOD_EXIST
    assert list(pb.ExistResponse.FromString(payload).statuses) == [pb.STATUS_NOT_FOUND]


async def test_mutual_tls_requires_a_client_certificate(start_master, pki, lean_socket) -> None:
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"],
                          tls_ca=pki["ca.crt"])
    with_cert = MasterRpc(master.address, tls=TlsConfig(pki["ca.crt"], pki["client.crt"],
                                                        pki["client.key"]))
    try:
        await _round_trip(with_cert, "m", master.metrics_url)
    finally:
        await with_cert.close()
    without_cert = MasterRpc(master.address, tls=TlsConfig(ca_path=pki["ca.crt"]),
                             timeout_s=2.0)
    try:
        with pytest.raises(KVPoolError) as err:
            await without_cert.register_client("n", "h", "")
        assert err.value.status in (Status.RPC_FAILED, Status.TIMEOUT)
    finally:
        await without_cert.close()
    context = ssl.create_default_context(cafile=pki["ca.crt"])
    with pytest.raises((ConnectionError, OSError)):
        conn = lean_socket(master.fast_port, ssl_context=context)
        conn.call(pb.METHOD_EXIST, pb.ExistRequest(keys=[b"a"]).SerializeToString())


async def test_token_is_required_on_both_ports(start_master, tmp_path, lean_socket) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    master = start_master(auth_token_file=str(token_file))
    good = MasterRpc(master.address, auth_token=TOKEN)
    try:
        await _round_trip(good, "g", master.metrics_url)
    finally:
        await good.close()
    for token in ("", "wrong"):
        bad = MasterRpc(master.address, auth_token=token)
        try:
            with pytest.raises(KVPoolError) as err:
                await bad.register_client("b", "h", "")
            assert err.value.status == Status.PERMISSION_DENIED
        finally:
            await bad.close()

    exist = pb.ExistRequest(keys=[b"a"]).SerializeToString()
    no_auth = lean_socket(master.fast_port)
    method, payload = no_auth.call(pb.METHOD_EXIST, exist)
    assert method == pb.METHOD_ERROR and payload.startswith(b"PERMISSION_DENIED: ")
    wrong = lean_socket(master.fast_port)
    method, payload = wrong.call(pb.METHOD_AUTH, pb.AuthRequest(token="nope")
                                 .SerializeToString())
    assert pb.AuthResponse.FromString(payload).status == pb.STATUS_PERMISSION_DENIED
    with pytest.raises(ConnectionError):
        wrong.call(pb.METHOD_EXIST, exist)
    right = lean_socket(master.fast_port)
    _, payload = right.call(pb.METHOD_AUTH, pb.AuthRequest(token=TOKEN).SerializeToString())
    assert pb.AuthResponse.FromString(payload).status == pb.STATUS_OK
    method, payload = right.call(pb.METHOD_EXIST, exist)
    assert method == pb.METHOD_EXIST

    refusals = _metric_lines(master.metrics_url, "kvpool_refusals_total")
    assert 'kvpool_refusals_total{reason="bad_token",transport="grpc"} 2.0' in refusals
    assert 'kvpool_refusals_total{reason="no_token",transport="lean"} 1.0' in refusals
    assert 'kvpool_refusals_total{reason="bad_token",transport="lean"} 1.0' in refusals


async def test_token_with_mutual_tls_on_the_lean_path(start_master, pki) -> None:
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"],
                          tls_ca=pki["ca.crt"], auth_token=TOKEN)
    rpc = MasterRpc(master.address, tls=TlsConfig(pki["ca.crt"], pki["client.crt"],
                                                  pki["client.key"]), auth_token=TOKEN)
    try:
        await _round_trip(rpc, "both", master.metrics_url)
    finally:
        await rpc.close()

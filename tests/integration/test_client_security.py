"""Client-side security: mutual TLS and a token from the client config, and a data server that
refuses (and counts) requests without a valid capability."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Placement, SegmentId


@pytest.mark.parametrize("partitions", [1, 2])
def test_client_over_mutual_tls_with_a_token(start_master: Any, pki: dict[str, str],
                                            partitions: int) -> None:
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"],
                          tls_ca=pki["ca.crt"], auth_token="s3cret", partitions=partitions)
    values = {"master_server_address": master.address, "global_segment_size": "8mb",
              "tls_ca": pki["ca.crt"], "tls_cert": pki["client.crt"],
              "tls_key": pki["client.key"], "auth_token": "s3cret", "rpc_timeout_s": 5}
    with KVPoolClient(ClientConfig.from_dict(values)) as c:
        c.put("over-tls", b"sealed" * 1000)
        assert c.get("over-tls") == b"sealed" * 1000
        # with partitions, every partition over TLS and the token
        keys = [f"sealed-{i}" for i in range(40)]
        assert c.put_batch(keys, [b"s" * 4096] * 40) == [Status.OK] * 40
        assert c.get_batch(keys) == [b"s" * 4096] * 40
        assert len(c.async_client.member.session.partitions) == (partitions if partitions > 1
                                                                  else 0)
        assert c.async_client.member.datapath is not None
        assert c.async_client.member.datapath.rpc.fast_port > 0  # the lean path runs over TLS too
    done = subprocess.run([sys.executable, "-m", "kvpool_client.cli", "status", "--master",
                           master.address, "--tls-ca", pki["ca.crt"], "--tls-cert",
                           pki["client.crt"], "--tls-key", pki["client.key"], "--auth-token",
                           "s3cret"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_wrong_token_or_no_tls_is_a_clear_error(start_master: Any, pki: dict[str, str]) -> None:
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"],
                          auth_token="s3cret")
    base = {"master_server_address": master.address, "rpc_timeout_s": 2,
            "tls_ca": pki["ca.crt"]}
    with pytest.raises(KVPoolError) as info:
        KVPoolClient(ClientConfig.from_dict({**base, "auth_token": "guess"}))
    assert info.value.status == Status.PERMISSION_DENIED
    plaintext = {"master_server_address": master.address, "rpc_timeout_s": 2,
                 "auth_token": "s3cret"}
    with pytest.raises(KVPoolError) as info:
        KVPoolClient(ClientConfig.from_dict(plaintext))
    assert info.value.status in (Status.RPC_FAILED, Status.TIMEOUT)


def test_forged_capabilities_are_refused_and_counted(master: Any) -> None:
    config = ClientConfig.from_dict({"master_server_address": master.address,
                                     "global_segment_size": "4mb", "transport": "tcp"})
    with KVPoolClient(config) as c:
        c.put("guarded", b"g" * 4096)
        path = c.async_client.member.datapath
        assert path is not None
        (segment_id,) = c.segment_ids
        info = c._thread.run(path.resolve([segment_id]))[segment_id]
        forged = Placement(SegmentId(segment_id), 0, 4096, capability_expiry_ms=2**62,
                           capability=b"\x00" * 16)
        with pytest.raises(KVPoolError) as refused:
            c._thread.run(path.tcp.write(info, forged, [memoryview(b"x" * 4096)]))
        assert refused.value.status == Status.PERMISSION_DENIED
        assert c.metrics.refusals()["refused"] == 1
        assert c.get("guarded") == b"g" * 4096  # not a byte changed

"""Security with real clients: KVPoolClient over TLS and mutual TLS with a token works; a
plaintext client, a client without a certificate and a client with a wrong token are refused;
forged, unsigned and expired data-plane capabilities against a client's data server are all
refused, counted, and change no byte."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

import pytest
import uvloop

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.transfer import TcpTransport
from kvpool_wire import capability
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import Op, Placement, SegmentInfo

TOKEN = "reliability-test-token"
SEGMENT_BYTES = 16 << 20

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")




def _config(address: str, **values: Any) -> ClientConfig:
    return ClientConfig.from_dict({"master_server_address": address, "global_segment_size": 0,
                                   "rpc_timeout_s": 2, **values})


def test_tls_mtls_and_token_with_real_clients(start_master: Any, pki: dict[str, str]) -> None:
    master = start_master(tls_cert=pki["server.crt"], tls_key=pki["server.key"],
                          tls_ca=pki["ca.crt"], auth_token=TOKEN)
    good = {"tls_ca": pki["ca.crt"], "tls_cert": pki["client.crt"], "tls_key": pki["client.key"],
            "auth_token": TOKEN}
    with KVPoolClient(_config(master.address, global_segment_size="4mb", **good)) as c:
        c.put("secure", b"s" * 5000)
        assert c.get("secure") == b"s" * 5000
        print("mTLS + token client: put and get work")
    refused = []
    for name, values in (("plaintext", {"auth_token": TOKEN}),
                         ("TLS without client certificate",
                          {"tls_ca": pki["ca.crt"], "auth_token": TOKEN}),
                         ("mTLS with wrong token", {**good, "auth_token": "wrong"}),
                         ("mTLS without token", {**good, "auth_token": ""})):
        with pytest.raises(KVPoolError) as err:
            KVPoolClient(_config(master.address, **values))
        assert err.value.status in (Status.RPC_FAILED, Status.TIMEOUT, Status.PERMISSION_DENIED)
        refused.append(f"{name}: {err.value.status.name}")
    print(f"unauthenticated clients refused: {len(refused)}/4 ({'; '.join(refused)})")
    assert len(refused) == 4


def test_forged_capabilities_are_refused_by_a_real_client(start_master: Any) -> None:
    master = start_master()
    with KVPoolClient(_config(master.address, global_segment_size=SEGMENT_BYTES,
                              transport="tcp")) as owner:
        keys = [f"guarded-{i}" for i in range(20)]
        values = [os.urandom(64 << 10) for _ in keys]
        assert all(s == Status.OK for s in owner.put_batch(keys, values))
        segment_id = owner.segment_ids[0]
        info = SegmentInfo(segment_id, owner.client_id, SEGMENT_BYTES, host_id="elsewhere",
                           tcp_endpoint=owner.hostname)
        now_ms = int(time.time() * 1000)
        cases: list[tuple[Op, Placement]] = []
        for i in range(50):
            offset = (i * 300_007) % (SEGMENT_BYTES - 4096)
            other_key = os.urandom(32)
            signed = capability.sign(other_key, segment_id, offset, 4096, Op.WRITE,
                                     now_ms + 60_000)
            for op in (Op.WRITE, Op.READ):
                cases += [
                    (op, Placement(segment_id, offset, 4096)),  # no capability at all
                    (op, Placement(segment_id, offset, 4096, now_ms + 60_000, os.urandom(16))),
                    (op, Placement(segment_id, offset, 4096, now_ms + 60_000, signed)),
                    (op, Placement(segment_id, offset, 4096, now_ms - 1, signed)),
                ]

        async def attack() -> list[Status]:
            tcp = TcpTransport(timeout_s=2.0)
            try:
                statuses = []
                for op, placement in cases:
                    regions = [memoryview(bytearray(os.urandom(4096)))]
                    batch = tcp.write_batch if op == Op.WRITE else tcp.read_batch
                    statuses += await batch([(info, dataclasses.replace(placement), regions)])
                return statuses
            finally:
                await tcp.close()

        statuses = uvloop.run(attack())
        refused = sum(s == Status.PERMISSION_DENIED for s in statuses)
        counted = sum(owner.metrics.refusals().values())
        intact = sum(v == value for v, value in zip(owner.get_batch(keys), values, strict=True))
        print(f"forged/unsigned/expired capability requests refused: {refused}/{len(cases)} "
              f"(data server counted {counted}); objects intact {intact}/{len(keys)}")
        assert refused == len(cases)
        assert counted >= len(cases)
        assert intact == len(keys)

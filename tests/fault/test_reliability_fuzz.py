"""Seeded fuzzing against live processes with real segments: 10,000 malformed master RPCs
(lean frames and gRPC) and 10,000 garbage frames to a real client's data server. The master
and the data server keep serving; no byte of the client's shared-memory segment changes (its
xxh3-128 digest, read from /dev/shm, is the same before and after).

A client id is not a credential: the RPCs name other clients, and about half of those naming
"mallory" carry mallory's own valid token (mallory is a registered client), so they pass
authentication and reach the handlers' ownership rules. The data-plane frames are of the current
wire version, and many name the segment with a capability range covering the request, so they
reach the capability check (a WRITE's payload is then read and dropped)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import socket
import struct
import time
from typing import Any

import grpc
import xxhash

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.segments import SHM_DIR
from kvpool_client.transfer import tcp_frames
from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire._pb import kvpool_pb2_grpc as pb_grpc
from kvpool_wire.methods import RPC_METHODS
from kvpool_wire.types import Pin, PutOptions

SEED = 6_20261123
REQUESTS = 10_000
EXCLUDED = {"RemoveAll", "RemoveByRegex"}  # valid admin commands, not malformed input
METHODS = [m for m in RPC_METHODS.values() if m.name not in EXCLUDED]
LEAN_IDS = [i for i in range(256) if i not in {RPC_METHODS[n].method_id for n in EXCLUDED}]


def segment_digest(client_id: str) -> str:
    paths = glob.glob(os.path.join(SHM_DIR, f"kvpool.*.{client_id}.*"))
    assert len(paths) == 1, paths
    with open(paths[0], "rb") as f:
        return xxhash.xxh3_128_hexdigest(f.read())


def mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data or b"\x00")
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(len(buf))
        if rng.random() < 0.6:
            buf[pos] = rng.randrange(256)
        else:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
    return bytes(buf)


def valid_request(rng: random.Random, segment_id: str, mallory_token: bytes
                  ) -> tuple[str, bytes]:
    """A plausible request to mutate, and its method's name: from a client that is not the
    owner (a client id is not a credential). Half of mallory's carry its valid token, so they
    reach the ownership rules."""
    owner_id = rng.choice(["mallory", "ghost", ""])
    token = mallory_token if owner_id == "mallory" and rng.random() < 0.5 else b""
    # Never the owner's keys: a payload of one message sent as another method's can be a
    # well-formed Remove of them, which is a valid command.
    keys = [b"fz-" + rng.randbytes(6) for _ in range(3)]
    request = rng.choice([
        pb.PutStartRequest(client_id=owner_id, keys=keys, sizes_bytes=[4096] * 3,
                           client_token=token),
        pb.PutEndRequest(client_id=owner_id, keys=keys, client_token=token),
        pb.PutRevokeRequest(client_id=owner_id, keys=keys, client_token=token),
        pb.UnmountSegmentRequest(client_id=owner_id, segment_id=segment_id, client_token=token),
        pb.GetReplicasRequest(client_id=owner_id, keys=keys),
        pb.RemoveRequest(keys=[rng.randbytes(8)]),
        pb.MountSegmentRequest(client_id=owner_id, client_token=token,
                               segment=pb.SegmentDescriptor(segment_id=segment_id,
                                                            client_id=owner_id,
                                                            size_bytes=1 << 20)),
    ])
    return request.DESCRIPTOR.name.removesuffix("Request"), request.SerializeToString()


class Lean:
    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None

    def send(self, data: bytes) -> None:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=2)
        try:
            self.sock.sendall(data)
            self.sock.settimeout(0.5)
            header = self.sock.recv(9)
            if len(header) < 9:
                raise ConnectionError
            (length,) = struct.unpack_from("<I", header)
            left = length - 5
            while left > 0:
                chunk = self.sock.recv(min(left, 1 << 16))
                if not chunk:
                    raise ConnectionError
                left -= len(chunk)
        except OSError:
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def test_malformed_rpcs_change_no_segment_byte(start_master: Any) -> None:
    # mallory never heartbeats: its client_ttl outlasts the loop's time bound.
    master = start_master(client_ttl=240)
    cfg = ClientConfig.from_dict({"master_server_address": master.address,
                                  "global_segment_size": "4mb", "rpc_timeout_s": 5})
    with KVPoolClient(cfg) as owner:
        keys = [f"obj-{i}" for i in range(50)]
        values = [os.urandom(4096 + i) for i in range(50)]
        # Pinned: mallory's authenticated puts may fill the segment, and eviction of the
        # owner's objects would be the pool working as designed, not a changed byte.
        owner.put_batch(keys, values, options=PutOptions(pin=Pin.HARD))
        before = segment_digest(owner.client_id)
        rng = random.Random(SEED)
        lean = Lean(master.fast_port)
        channel = grpc.insecure_channel(master.address)
        stub = pb_grpc.MasterStub(channel)
        registered = stub.RegisterClient(pb.RegisterClientRequest(client_id="mallory",
                                                                  host_id="h"))
        assert registered.status == pb.STATUS_OK and registered.client_token
        mallory_token = registered.client_token
        segment_id = owner.segment_ids[0]
        started = time.monotonic()
        try:
            for _ in range(REQUESTS):
                method = rng.choice(METHODS)
                roll = rng.random()
                if roll < 0.4:
                    payload = rng.randbytes(rng.randint(0, 64))
                else:
                    name, request = valid_request(rng, segment_id, mallory_token)
                    payload = mutate(rng, request)
                    if rng.random() < 0.5:  # to its own method, else to any
                        method = RPC_METHODS[name]
                if rng.random() < 0.85:
                    method_id = method.method_id if roll < 0.8 else rng.choice(LEAN_IDS)
                    lean.send(struct.pack("<IBI", len(payload) + 5, method_id,
                                          rng.getrandbits(32)) + payload)
                else:
                    with contextlib.suppress(grpc.RpcError):
                        channel.unary_unary(method.path)(payload, timeout=5)
                assert time.monotonic() - started < 120
            # mallory's valid-token puts reached the core (placed on the owner's segment:
            # bytes of it are only written through the owner's data server)...
            totals = json.loads(stub.GetStats(pb.GetStatsRequest()).json)["totals"]
            assert totals["put_started_total"] > len(keys), totals
            # ...mallory is still authenticated, and its own valid token does not let it take
            # the owner's segment.
            assert stub.Heartbeat(pb.HeartbeatRequest(
                client_id="mallory", client_token=mallory_token)).status == pb.STATUS_OK
            assert stub.UnmountSegment(pb.UnmountSegmentRequest(
                client_id="mallory", segment_id=segment_id, client_token=mallory_token)
            ).status == pb.STATUS_PERMISSION_DENIED
        finally:
            lean.close()
            channel.close()
        elapsed_s = time.monotonic() - started
        after = segment_digest(owner.client_id)
        intact = sum(v == value for v, value in zip(owner.get_batch(keys), values, strict=True))
        alive = master.proc.poll() is None
        print(f"{REQUESTS} malformed RPCs in {elapsed_s:.1f} s: master alive {alive}, segment "
              f"digest unchanged {before == after}; objects intact {intact}/{len(keys)}")
        assert alive and before == after and intact == len(keys)
        assert "Traceback" not in master.log()


def test_garbage_frames_to_a_real_data_server_change_no_byte(start_master: Any) -> None:
    master = start_master()
    cfg = ClientConfig.from_dict({"master_server_address": master.address,
                                  "global_segment_size": "4mb", "rpc_timeout_s": 5,
                                  "transport": "tcp", "transfer_timeout_s": 1})
    with KVPoolClient(cfg) as owner, KVPoolClient(cfg.replace(global_segment_size=0)) as peer:
        keys = [f"obj-{i}" for i in range(50)]
        values = [os.urandom(4096 + i) for i in range(50)]
        owner.put_batch(keys, values)
        before = segment_digest(owner.client_id)
        host, port = owner.hostname.rsplit(":", 1)
        segment_id = owner.segment_ids[0].encode()
        rng = random.Random(SEED)
        started = time.monotonic()
        for _ in range(REQUESTS):
            kind = rng.randrange(3)
            if kind == 0:
                frame = rng.randbytes(rng.randrange(1, 200))
            else:
                seg = segment_id if kind == 1 else rng.randbytes(rng.randrange(0, 40))
                offset, length = rng.randrange(4 << 20), rng.randrange(1, 8192)
                # Half cover the request with their capability range: those reach the MAC.
                cap_range = ((offset, length) if rng.random() < 0.5 else
                             (rng.randrange(4 << 20), rng.randrange(1, 8192)))
                version = tcp_frames.VERSION
                frame = tcp_frames.REQUEST.pack(
                    tcp_frames.REQUEST_MAGIC, rng.choice([version, version, 1, 9]),
                    rng.choice([1, 2, rng.randrange(256)]), len(seg), rng.getrandbits(64),
                    offset, length, *cap_range, rng.getrandbits(63), rng.getrandbits(64),
                    rng.randbytes(16)) + seg + rng.randbytes(rng.randrange(64))
                frame = frame[:rng.randrange(1, len(frame) + 1)]
            with socket.create_connection((host, int(port)), timeout=2) as sock, \
                    contextlib.suppress(OSError):
                sock.sendall(frame)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
            assert time.monotonic() - started < 120
        elapsed_s = time.monotonic() - started
        after = segment_digest(owner.client_id)
        intact = sum(v == value for v, value in zip(peer.get_batch(keys), values, strict=True))
        refusals = owner.metrics.refusals()
        print(f"{REQUESTS} garbage data-plane frames in {elapsed_s:.1f} s: segment digest "
              f"unchanged {before == after}; objects intact over tcp {intact}/{len(keys)}; "
              f"data server refusals {refusals}")
        assert before == after and intact == len(keys)
        # Frames got past the header checks to the segment, bounds and capability checks.
        assert refusals["refused"] > 0, refusals

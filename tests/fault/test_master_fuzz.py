"""At least 10,000 randomized malformed requests against a live master (seeded, time-bounded).

Sources of bad input, mixed at random:
- raw lean frames: random method ids and request ids, random payload bytes, byte-flipped valid
  requests, random garbage streams (bad lengths, half frames);
- gRPC: random message bytes and byte-flipped valid requests on every method, unknown methods;
- well-formed requests with bad contents: empty/oversized keys, huge and zero sizes,
  mismatched lists, unknown clients and segments, another client's put, a 100,001-key batch.

About half of the client-scoped requests naming mallory (a registered client) carry mallory's
own valid token, so they pass authentication and reach the handlers behind it (placement,
ownership of the victim's pending put and segment); the rest stop at authentication. When a
fuzzed request unregisters mallory, a fresh registered identity takes its place.

Pass: the master keeps serving; every answer is a parseable response whose statuses are known
Status values, a lean error frame naming a Status, or a gRPC INVALID_ARGUMENT /
RESOURCE_EXHAUSTED / UNIMPLEMENTED; no internal error is logged; a valid client's objects are
unchanged (same sizes, checksums, placements) and its pending put can still be committed;
mallory's authenticated commits and revokes of that put are PERMISSION_DENIED; authenticated
requests got answers only the handlers behind authentication give.
Admin removals (RemoveAll, RemoveByRegex) are valid commands rather than malformed input, so the
fuzzer does not send them.
"""

from __future__ import annotations

import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
from token_stub import TokenStub

from kvpool_wire._pb import kvpool_pb2 as pb
from kvpool_wire._pb import kvpool_pb2_grpc as pb_grpc
from kvpool_wire.methods import RPC_METHODS
from kvpool_wire.status import Status

SEED = 20240611
MIN_REQUESTS = 10_000
TIME_BUDGET_S = 120.0
STATUS_VALUES = {int(s) for s in Status}
STATUS_NAMES = {s.name.encode() for s in Status}
EXCLUDED = {"RemoveAll", "RemoveByRegex"}
METHODS = [m for m in RPC_METHODS.values() if m.name not in EXCLUDED]
RANDOM_METHOD_IDS = [i for i in range(256)
                     if i not in {RPC_METHODS[name].method_id for name in EXCLUDED}]
OK_GRPC_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.UNIMPLEMENTED}
#: What a client-scoped call can answer without passing authentication.
AUTH_STATUSES = {pb.STATUS_UNKNOWN_CLIENT, pb.STATUS_PERMISSION_DENIED,
                 pb.STATUS_INVALID_ARGUMENT}
TOKEN_FRACTION = 0.5


@dataclass
class Identity:
    """The registered client whose valid token the fuzzer hands to some of its requests."""

    client_id: str
    token: bytes

    def pick(self, rng: random.Random, client_id: str) -> tuple[str, bytes]:
        """(client id, token) for a request naming ``client_id``: mallory's requests carry
        this identity's valid token in TOKEN_FRACTION of the cases."""
        if client_id == "mallory" and rng.random() < TOKEN_FRACTION:
            return self.client_id, self.token
        return client_id, b""


def _check_answer(method, payload: bytes) -> list[int]:
    response = method.response_type.FromString(payload)
    statuses = list(getattr(response, "statuses", [])) + (
        [response.status] if hasattr(response, "status") else [])
    unknown = set(statuses) - STATUS_VALUES
    assert not unknown, f"{method.name} answered unknown statuses {unknown}"
    return statuses


class LeanFuzzer:
    """Raw frames on the lean port, reconnecting whenever the master closes the connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None
        self.closes = 0

    def _connect(self) -> socket.socket:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        return self.sock

    def _drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            self.closes += 1

    def _read_frame(self, sock: socket.socket) -> tuple[int, int, bytes] | None:
        def exact(n: int) -> bytes | None:
            data = b""
            while len(data) < n:
                chunk = sock.recv(n - len(data))
                if not chunk:
                    return None
                data += chunk
            return data

        header = exact(9)
        if header is None:
            return None
        length, method, request_id = struct.unpack("<IBI", header)
        body = exact(length - 5)
        return None if body is None else (method, request_id, body)

    def frame(self, method_id: int, request_id: int, payload: bytes) -> list[int] | None:
        """Send one frame; return the statuses of its answer (None: no answer message)."""
        sock = self._connect()
        try:
            sock.sendall(struct.pack("<IBI", len(payload) + 5, method_id, request_id) + payload)
            answer = self._read_frame(sock)
        except (ConnectionError, TimeoutError, OSError):
            self._drop()
            return None
        if answer is None:
            self._drop()
            return None
        answer_method, answer_id, body = answer
        if answer_method == pb.METHOD_ERROR:
            assert body.split(b": ", 1)[0] in STATUS_NAMES, body[:200]
            self._drop()  # the master closes after an error frame
            return None
        assert (answer_method, answer_id) == (method_id, request_id)
        if answer_method == pb.METHOD_AUTH:
            assert pb.AuthResponse.FromString(body).status == pb.STATUS_OK
            return None
        method = next(m for m in RPC_METHODS.values() if m.method_id == method_id)
        return _check_answer(method, body)

    def garbage(self, data: bytes) -> None:
        """Bytes that may not even be a frame: expect an error frame, a close or silence."""
        sock = self._connect()
        try:
            sock.sendall(data)
            sock.settimeout(0.05)
            answer = self._read_frame(sock)
            if answer is not None and answer[0] == pb.METHOD_ERROR:
                assert answer[2].split(b": ", 1)[0] in STATUS_NAMES
        except (ConnectionError, TimeoutError, OSError):
            pass
        self._drop()  # the stream is out of sync either way


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data or b"\x00")
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        pos = rng.randrange(len(buf))
        if choice < 0.5:
            buf[pos] = rng.randrange(256)
        elif choice < 0.75:
            del buf[pos:pos + rng.randint(1, 8)]
            if not buf:
                buf.append(rng.randrange(256))
        else:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
    return bytes(buf)


def _bad_contents(rng: random.Random, victim_pending: list[bytes], me: Identity
                  ) -> tuple[str, bytes, bool]:
    """A well-formed request whose contents are wrong in one of many ways, and whether it
    carries a valid token."""
    keys = rng.choice([[b""], [b"k" * 1025], [rng.randbytes(rng.randint(1, 40))],
                       [rng.randbytes(8) for _ in range(rng.randint(0, 50))]])
    sizes = [rng.choice([0, 1, 2**63, 2**64 - 1, 1 << 40, rng.randrange(1, 4096)])
             for _ in range(len(keys) + rng.choice([0, 0, 0, 1, -1]) if keys else 0)]
    client, token = me.pick(rng, rng.choice(["mallory", "ghost", "",
                                             "victim"[: rng.randint(0, 5)]]))
    kind = rng.randrange(8)
    if kind == 0:
        return "PutStart", pb.PutStartRequest(
            client_id=client, keys=keys, sizes_bytes=sizes, client_token=token,
            parent_keys=rng.choice([[], [b"p"] * len(keys), [b"x"]]),
            options=pb.PutOptions(replica_num=rng.randrange(0, 20),
                                  preferred_segment=rng.choice(["", "nope", "victim/0"]),
                                  pin=rng.randrange(0, 5))).SerializeToString(), bool(token)
    if kind == 1:  # another client's put
        client, token = me.pick(rng, rng.choice(["mallory", "ghost"]))
        name = rng.choice(["PutEnd", "PutRevoke"])
        request = RPC_METHODS[name].request_type(client_id=client, keys=victim_pending + keys,
                                                 client_token=token)
        return name, request.SerializeToString(), bool(token)
    if kind == 2:
        return "MountSegment", pb.MountSegmentRequest(
            client_id=client, client_token=token, segment=pb.SegmentDescriptor(
                segment_id=rng.choice(["", "victim/0", "m/" + str(rng.randrange(99))]),
                client_id=rng.choice(["", "victim", "mallory", client]),
                size_bytes=rng.choice([0, 1, 2**64 - 1, 4096]),
                tier=rng.randrange(0, 4))).SerializeToString(), bool(token)
    if kind == 3:
        client, token = me.pick(rng, rng.choice(["mallory", "ghost"]))
        return "UnmountSegment", pb.UnmountSegmentRequest(
            client_id=client, client_token=token,
            segment_id=rng.choice(["victim/0", "nope", ""])).SerializeToString(), bool(token)
    if kind == 4:
        return "GetSegments", pb.GetSegmentsRequest(
            segment_ids=[rng.choice(["victim/0", "", "x" * 600])]).SerializeToString(), False
    if kind == 5:
        return "Remove", pb.RemoveRequest(keys=keys, force=rng.random() < 0.5
                                          ).SerializeToString(), False
    if kind == 6:  # a known id re-registers only with its token
        client_id = rng.choice(["", "x" * 600, "m" + str(rng.randrange(50)), "victim"])
        client_id, token = me.pick(rng, rng.choice([client_id, "mallory"]))
        return "RegisterClient", pb.RegisterClientRequest(
            client_id=client_id, client_token=token,
            host_id=rng.choice(["", "h", "h" * 600])).SerializeToString(), bool(token)
    return rng.choice(["Exist", "GetReplicas", "QueryPrefix"]), pb.ExistRequest(
        keys=keys).SerializeToString(), False


def _valid_request(rng: random.Random, name: str, me: Identity) -> bytes:
    """A plausible request of ``name`` to mutate."""
    keys = [rng.randbytes(rng.randint(1, 24)) for _ in range(rng.randint(1, 6))]
    mallory, token = me.pick(rng, "mallory")
    builders = {
        "RegisterClient": lambda: pb.RegisterClientRequest(client_id=mallory, host_id="h",
                                                           client_token=token),
        "Heartbeat": lambda: pb.HeartbeatRequest(client_id=mallory, client_token=token),
        "UnregisterClient": lambda: pb.UnregisterClientRequest(client_id="ghost"),
        "MountSegment": lambda: pb.MountSegmentRequest(
            client_id=mallory, client_token=token, segment=pb.SegmentDescriptor(
                segment_id=f"{mallory}/1", client_id=mallory, size_bytes=1 << 20)),
        "UnmountSegment": lambda: pb.UnmountSegmentRequest(client_id="ghost", segment_id="g"),
        "GetSegments": lambda: pb.GetSegmentsRequest(segment_ids=["victim/0", "mallory/0"]),
        "PutStart": lambda: pb.PutStartRequest(client_id=mallory, keys=keys, client_token=token,
                                               sizes_bytes=[64] * len(keys)),
        "PutEnd": lambda: pb.PutEndRequest(client_id=mallory, keys=keys, checksums=[1] * 6,
                                           client_token=token),
        "PutRevoke": lambda: pb.PutRevokeRequest(client_id=mallory, keys=keys,
                                                 client_token=token),
        "GetReplicas": lambda: pb.GetReplicasRequest(client_id="mallory", keys=keys),
        "Exist": lambda: pb.ExistRequest(keys=keys),
        "QueryPrefix": lambda: pb.QueryPrefixRequest(keys=keys),
        "Remove": lambda: pb.RemoveRequest(keys=keys),
        "GetStats": lambda: pb.GetStatsRequest(),
        "CopyTasks": lambda: pb.CopyTasksRequest(
            client_id=mallory, client_token=token, max_tasks=(1 << 32) - 1, wait_ms=50,
            done=[pb.CopyResult(task_id=n, status=0) for n in range(1, 6)]),
    }
    return builders[name]().SerializeToString()


def _victim_view(stub: pb_grpc.MasterStub, keys: list[bytes]) -> list[tuple]:
    reply = stub.GetReplicas(pb.GetReplicasRequest(client_id="victim", keys=keys))
    return [(s, size, checksum, tuple((p.segment_id, p.offset, p.length) for p in r.placements))
            for s, size, checksum, r in zip(reply.statuses, reply.sizes_bytes, reply.checksums,
                                            reply.replicas, strict=True)]


def test_randomized_malformed_requests(start_master) -> None:
    # The victim never heartbeats: its client_ttl (and the life of its pending put) outlasts
    # the fuzz's whole time budget, so a slow machine cannot expire it.
    master = start_master(max_batch_keys=100_000, client_ttl=2 * TIME_BUDGET_S,
                          put_start_discard_timeout=2 * TIME_BUDGET_S)
    rng = random.Random(SEED)
    channel = grpc.insecure_channel(master.address)
    stub = TokenStub(channel)
    try:
        _register(stub, "victim")
        me = _register(stub, "mallory")
        victim_keys = [f"victim-{i}".encode() for i in range(32)]
        victim_pending = [b"victim-pending-0", b"victim-pending-1"]
        hard = pb.PutOptions(pin=pb.PIN_HARD)
        assert set(stub.PutStart(pb.PutStartRequest(
            client_id="victim", keys=victim_keys + victim_pending,
            sizes_bytes=[1000 + i for i in range(34)], options=hard)).statuses) == {0}
        assert set(stub.PutEnd(pb.PutEndRequest(client_id="victim", keys=victim_keys,
                                                checksums=range(1, 33))).statuses) == {0}
        before = _victim_view(stub, victim_keys)

        lean = LeanFuzzer(master.fast_port)
        counts = {"lean_random": 0, "lean_mutated": 0, "lean_garbage": 0, "grpc_random": 0,
                  "grpc_mutated": 0, "bad_contents": 0, "grpc_unknown": 0, "huge_batch": 0,
                  "identities": 1, "ownership_denials": 0}
        authenticated: Counter[str] = Counter()  # statuses answered to valid-token requests
        started_s = time.monotonic()
        total = 0
        huge = [i.to_bytes(8, "little") for i in range(100_001)]
        big = pb.PutStartRequest(client_id="mallory", keys=huge, sizes_bytes=[64] * len(huge))
        with pytest.raises(grpc.RpcError) as refused:   # refused for the call, at once
            stub.PutStart(big, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        counts["huge_batch"] += 1
        while total < MIN_REQUESTS and time.monotonic() - started_s < TIME_BUDGET_S:
            if total % 200 == 0 and stub.Heartbeat(pb.HeartbeatRequest(
                    client_id=me.client_id, client_token=me.token)).status != pb.STATUS_OK:
                me = _register(stub, f"mallory-{total}")  # a fuzzed call unregistered it
                counts["identities"] += 1
            roll = rng.random()
            method = rng.choice(METHODS)
            if roll < 0.25:
                lean.frame(rng.choice(RANDOM_METHOD_IDS), rng.getrandbits(32),
                           rng.randbytes(rng.randint(0, 64)))
                counts["lean_random"] += 1
            elif roll < 0.45:
                lean.frame(method.method_id, rng.getrandbits(32),
                           _mutate(rng, _valid_request(rng, method.name, me)))
                counts["lean_mutated"] += 1
            elif roll < 0.50:
                lean.garbage(rng.randbytes(rng.randint(1, 32)))
                counts["lean_garbage"] += 1
            elif roll < 0.80:
                name, payload, tokened = _bad_contents(rng, victim_pending, me)
                target = RPC_METHODS[name]
                if rng.random() < 0.5:
                    statuses = lean.frame(target.method_id, rng.getrandbits(32), payload)
                else:
                    statuses = _grpc_call(channel, target, payload)
                if tokened and statuses:
                    authenticated.update(pb.Status.Name(status) for status in statuses)
                    if name in ("PutEnd", "PutRevoke"):  # the victim's pending keys first
                        assert set(statuses[:2]) <= {pb.STATUS_PERMISSION_DENIED,
                                                     pb.STATUS_UNKNOWN_CLIENT}, statuses
                        if set(statuses) - AUTH_STATUSES:  # past authentication
                            counts["ownership_denials"] += 1
                counts["bad_contents"] += 1
            elif roll < 0.90:
                payload = rng.randbytes(rng.randint(0, 64))
                _grpc_call(channel, method, payload)
                counts["grpc_random"] += 1
            elif roll < 0.99:
                _grpc_call(channel, method, _mutate(rng, _valid_request(rng, method.name, me)))
                counts["grpc_mutated"] += 1
            else:
                try:
                    channel.unary_unary("/kvpool.v1.Master/NoSuchMethod")(b"", timeout=10)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
                counts["grpc_unknown"] += 1
            total += 1
        elapsed_s = time.monotonic() - started_s
        print(f"fuzz: {total} malformed requests in {elapsed_s:.1f} s "
              f"({lean.closes} lean connections closed by the master): {counts}; answers to "
              f"valid-token requests: {dict(authenticated)}")
        assert total >= MIN_REQUESTS, f"only {total} requests in {TIME_BUDGET_S} s"
        # Valid-token requests reached the handlers behind authentication.
        assert counts["ownership_denials"] > 0
        assert {"STATUS_OK", "STATUS_NO_SPACE", "STATUS_INVALID_KEY"} <= set(authenticated)

        # Still serving, the victim's objects unchanged, its pending put still its own.
        assert stub.Heartbeat(pb.HeartbeatRequest(client_id="victim")).status == 0
        assert _victim_view(stub, victim_keys) == before
        assert list(stub.PutEnd(pb.PutEndRequest(client_id="victim", keys=victim_pending))
                    .statuses) == [0, 0]
        log = master.log()
        assert "Traceback" not in log and "failed unexpectedly" not in log, log[-4000:]
    finally:
        channel.close()


def _register(stub: TokenStub, client_id: str) -> Identity:
    """Register ``client_id`` with a 4 MiB segment; return it with its token."""
    reply = stub.RegisterClient(pb.RegisterClientRequest(client_id=client_id, host_id="h"))
    assert reply.status == pb.STATUS_OK and reply.client_token
    assert stub.MountSegment(pb.MountSegmentRequest(
        client_id=client_id, client_token=reply.client_token, segment=pb.SegmentDescriptor(
            segment_id=f"{client_id}/0", client_id=client_id, size_bytes=1 << 22))
    ).status == pb.STATUS_OK
    return Identity(client_id, reply.client_token)


def _grpc_call(channel: grpc.Channel, method, payload: bytes) -> list[int] | None:
    """Call ``method`` with ``payload``; return its answer's statuses (None: a gRPC error)."""
    try:
        answer = channel.unary_unary(method.path)(payload, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() in OK_GRPC_CODES, (method.name, exc.code(), exc.details())
        return None
    return _check_answer(method, answer)

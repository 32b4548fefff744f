"""Client identity and capabilities against a real master and real clients on 127.0.0.1.

- No caller acts as another client: a client id alone (readable from segment ids and
  GetStats) gives neither the client's key nor the right to register, heartbeat, mount,
  commit, revoke or unregister as it.
- A process restarted with a fixed client id within client_ttl gets a working pool: it waits
  until the master has expired its dead predecessor, instead of being handed the dead
  process's identity and failing every put.
- A WRITE capability outlives neither its use nor the space it names: after a put is revoked,
  its range is reused only once every capability for it has expired, so a late write through
  the owner's data server never lands on the next object.
- Capabilities expire on the master's own clock: a master whose wall clock is 40 s behind or
  ahead of its clients' changes nothing for TCP puts and gets.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import client_worker, wait_until

from kvpool_client.client import KVPoolClient
from kvpool_client.config import ClientConfig
from kvpool_client.rpc import ClientIdTaken, MasterRpc
from kvpool_client.transfer.tcp_frames import RESPONSE, encode_request
from kvpool_wire.status import KVPoolError, Status
from kvpool_wire.types import ClientId, Op, PutOptions, SegmentId, SegmentInfo


def config(address: str, **changes: Any) -> ClientConfig:
    values: dict[str, Any] = {"master_server_address": address, "global_segment_size": "8mb",
                              "rpc_timeout_s": 2, "heartbeat_interval_s": 0.2}
    values.update(changes)
    return ClientConfig.from_dict(values)


def _raw_write(endpoint: str, placement: Any, data: bytes) -> Status:
    """Send one WRITE request with ``placement``'s capability to a data server; its status."""
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5.0) as sock:
        sock.sendall(encode_request(Op.WRITE, 1, placement.segment_id, placement.offset,
                                    len(data), placement.offset, placement.length,
                                    placement.capability_expiry_ms, placement.capability,
                                    placement.put_id) + data)
        header = b""
        while len(header) < RESPONSE.size:
            chunk = sock.recv(RESPONSE.size - len(header))
            assert chunk, "data server closed the connection"
            header += chunk
    return Status(RESPONSE.unpack(header)[3])


def test_an_impostor_cannot_act_as_a_live_client(master: Any) -> None:
    async def scenario() -> None:
        victim = MasterRpc(master.address, timeout_s=5.0)
        impostor = MasterRpc(master.address, timeout_s=5.0)
        try:
            registration = await victim.register_client("victim", "h", "")
            segment = SegmentInfo(SegmentId("victim-seg"), ClientId("victim"), 1 << 20,
                                  host_id="h", tcp_endpoint="127.0.0.1:1")
            assert await victim.mount_segment("victim", segment) == Status.OK
            (status, _), = await victim.put_start("victim", [b"half-written"], [4096],
                                                  PutOptions())
            assert status == Status.OK
            # The id is public; the key and the token are not.
            with pytest.raises(ClientIdTaken):
                await impostor.register_client("victim", "h", "")
            assert await impostor.put_end("victim", [b"half-written"]) == \
                [Status.UNKNOWN_CLIENT]              # a partial object never becomes readable
            assert await impostor.put_revoke("victim", [b"half-written"]) == \
                [Status.UNKNOWN_CLIENT]
            assert await impostor.unregister_client("victim") == Status.UNKNOWN_CLIENT
            assert await impostor.unmount_segment("victim", "victim-seg") == \
                Status.UNKNOWN_CLIENT
            with pytest.raises(KVPoolError) as copies:   # nor fetch or report its tier copies
                await impostor.copy_tasks("victim", [(1, Status.OK)], 64)
            assert copies.value.status == Status.UNKNOWN_CLIENT
            assert (await impostor.exist("x", [b"half-written"]))[0] == [Status.NOT_FOUND]
            # The victim is untouched: still registered, its segment and its put still there.
            assert await victim.heartbeat("victim") == Status.OK
            assert await victim.put_end("victim", [b"half-written"]) == [Status.OK]
            assert (await impostor.exist("x", [b"half-written"]))[0] == [Status.OK]
            again = await victim.register_client("victim", "h", "")  # proven by its token
            assert again.capability_key == registration.capability_key
            stats = await impostor.get_stats()
            print(f"impostor calls refused: {stats['totals']['calls_unauthenticated_total']}; "
                  f"registrations refused: {stats['totals']['registrations_refused_total']}")
            assert stats["totals"]["registrations_refused_total"] == 1
        finally:
            await victim.close()
            await impostor.close()

    asyncio.run(scenario())


WORKER = textwrap.dedent("""
    import sys, time
    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    client = KVPoolClient(ClientConfig.from_dict({
        "master_server_address": sys.argv[1], "client_id": sys.argv[2],
        "global_segment_size": "8mb", "rpc_timeout_s": 2, "heartbeat_interval_s": 0.2}))
    client.put("from-the-first-incarnation", b"1" * 4096)
    print("ready", flush=True)
    time.sleep(120)
""")


def test_a_fixed_client_id_restarted_within_client_ttl_gets_a_working_pool(
        start_master: Any) -> None:
    master = start_master(client_ttl=2)
    client_id = f"fixed-{os.getpid()}"
    first = subprocess.Popen([sys.executable, "-c", WORKER, master.address, client_id],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
        first.stdout.close()
    started = time.monotonic()
    with KVPoolClient(config(master.address, client_id=client_id)) as second:
        joined_s = time.monotonic() - started
        second.put("from-the-second-incarnation", b"2" * 4096)
        value = second.get("from-the-second-incarnation")
        old = second.get("from-the-first-incarnation")
        print(f"restarted fixed-id client joined after {joined_s:.2f} s (client_ttl 2 s); "
              f"its put and get work: {value == b'2' * 4096}; the dead process's object is "
              f"gone: {old is None}")
        assert value == b"2" * 4096
        assert old is None            # it lived on the dead process's segment
        assert joined_s < 2 + 3.0     # waited for the predecessor to expire, no longer


SECOND = textwrap.dedent("""
    import sys
    from kvpool_client.client import KVPoolClient
    from kvpool_client.config import ClientConfig
    from kvpool_wire.status import KVPoolError
    try:
        KVPoolClient(ClientConfig.from_dict({
            "master_server_address": sys.argv[1], "client_id": sys.argv[2],
            "global_segment_size": "8mb", "rpc_timeout_s": 2})).close()
        print("joined")
    except KVPoolError as exc:
        print(exc.status.name)
""")


def test_a_second_live_process_with_the_same_client_id_is_refused(start_master: Any) -> None:
    master = start_master(client_ttl=2)
    client_id = f"twice-{os.getpid()}"
    with KVPoolClient(config(master.address, client_id=client_id)) as first:
        started = time.monotonic()
        second = subprocess.run([sys.executable, "-c", SECOND, master.address, client_id],
                                capture_output=True, text=True, timeout=60)
        waited_s = time.monotonic() - started
        outcome = second.stdout.strip().splitlines()[-1]
        print(f"a second live process with the same client id: {outcome} after {waited_s:.1f} s")
        assert outcome == "CLIENT_ALREADY_EXISTS"
        first.put("still-mine", b"1")           # the holder was never disturbed
        assert first.get("still-mine") == b"1"


def test_a_revoked_puts_capability_never_writes_over_the_next_object(master: Any) -> None:
    payload = os.urandom(64 << 10)
    with KVPoolClient(config(master.address)), \
            KVPoolClient(config(master.address, global_segment_size=0,
                                transport="tcp")) as reader:
        async def stale_capability() -> Any:
            rpc = MasterRpc(master.address, timeout_s=5.0)
            try:
                await rpc.register_client("late-writer", "elsewhere", "")
                (status, (placement,)), = await rpc.put_start(
                    "late-writer", [b"revoked"], [len(payload)], PutOptions())
                assert status == Status.OK
                assert await rpc.put_revoke("late-writer", [b"revoked"]) == [Status.OK]
                return placement
            finally:
                await rpc.close()

        placement = asyncio.run(stale_capability())
        reader.put("next-object", payload)      # lands on the owner's segment too
        status = _raw_write(_owner_endpoint(master, placement.segment_id), placement,
                            b"\xee" * len(payload))
        intact = reader.get("next-object") == payload
        print(f"late write with a revoked put's capability answered {status.name}; the next "
              f"object intact: {intact}")
        assert intact


def test_a_late_write_into_a_segment_lost_and_mounted_again_never_lands_on_the_next_object(
        start_master: Any) -> None:
    # B's put into A's segment is in flight (its fill was handed the placement's memory, the
    # copy lands before done() returns, as the API allows). A pauses past its ttl, expires and
    # comes back with the same segment over the same memory. C's next object must not be
    # placed where B's late bytes still land while B's WRITE capability lives.
    size_bytes = 1 << 20
    master = start_master(client_ttl=1)
    owner = client_worker().Worker({"master_server_address": master.address,
                                    "global_segment_size": "16mb", "rpc_timeout_s": 1})
    try:
        segment = owner.info["segment_ids"][0]
        placed = PutOptions(preferred_segment=segment)
        with KVPoolClient(config(master.address, global_segment_size=0)) as late, \
                KVPoolClient(config(master.address, global_segment_size=0)) as next_writer:
            views: list[memoryview] = []
            filled, release = threading.Event(), threading.Event()

            def fill(_: int, view: memoryview) -> None:
                views.append(view)
                filled.set()

            def done() -> None:
                assert release.wait(30)
                views[0][:] = b"\xbb" * size_bytes   # the copy in flight lands only now

            answer: list[Any] = []
            writer = threading.Thread(target=lambda: answer.append(late.batch_put_with(
                ["late"], [size_bytes], fill, placed, done)))
            writer.start()
            assert filled.wait(10)
            os.kill(owner.pid, signal.SIGSTOP)
            try:
                assert wait_until(lambda: segment not in _mounted(master), 15)
            finally:
                os.kill(owner.pid, signal.SIGCONT)
            assert wait_until(lambda: segment in _mounted(master), 15)
            value = b"\xcc" * size_bytes
            assert next_writer.put_batch(["next"], [value], options=placed) == [Status.OK]
            release.set()
            writer.join(30)
            intact = next_writer.get("next") == value
            print(f"late write after its segment was lost and mounted again: put answered "
                  f"{answer[0][0].name}; the next object intact: {intact}")
            assert answer[0] != [Status.OK] and intact
    finally:
        owner.stop()


def _mounted(master: Any) -> set[str]:
    """The ids of the segments the master has mounted."""
    async def segments() -> set[str]:
        rpc = MasterRpc(master.address, timeout_s=5.0)
        try:
            document = await rpc.get_stats()
            return {s["segment_id"] for s in document["segments"]["list"]
                    if s.get("mounted", True)}
        finally:
            await rpc.close()
    return asyncio.run(segments())


def _owner_endpoint(master: Any, segment_id: str) -> str:
    async def lookup() -> str:
        rpc = MasterRpc(master.address, timeout_s=5.0)
        try:
            (info,) = await rpc.get_segments([segment_id])
            assert info is not None
            return info.tcp_endpoint
        finally:
            await rpc.close()
    return asyncio.run(lookup())


@pytest.mark.parametrize("skew_s", [-40.0, 40.0], ids=["master-40s-behind", "master-40s-ahead"])
def test_capabilities_do_not_depend_on_the_hosts_wall_clocks(start_master: Any, tmp_path: Path,
                                                            skew_s: float) -> None:
    # The master's process sees a wall clock off by skew_s (as on another host), nothing else.
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import time
        _real_time, _real_time_ns = time.time, time.time_ns
        time.time = lambda: _real_time() + {skew_s}
        time.time_ns = lambda: _real_time_ns() + {int(skew_s * 1e9)}
    """))
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    master = start_master(env={"PYTHONPATH": path})
    with KVPoolClient(config(master.address)) as owner, \
            KVPoolClient(config(master.address, global_segment_size=0,
                                transport="tcp")) as remote:
        values = {f"skew-{i}": os.urandom(32 << 10) for i in range(8)}
        remote.put_batch(list(values), list(values.values()))
        read = remote.get_batch(list(values))
        exact = sum(v == values[k] for k, v in zip(values, read, strict=True))
        print(f"master wall clock {skew_s:+.0f} s: {exact}/{len(values)} TCP puts read back "
              f"byte-exact")
        assert exact == len(values)
        assert owner.get("skew-0") == values["skew-0"]

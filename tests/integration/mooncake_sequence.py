"""One call sequence against a Mooncake Store Python client, printed as JSON.

Run as ``python mooncake_sequence.py --module MODULE --master HOST:PORT``, where MODULE is
``kvpool_client.compat.mooncake`` (kvpool, any Python with kvpool installed) or
``mooncake.store`` (the real Mooncake wheel, for example in /tmp/peer-venv). It imports
neither pytest nor kvpool itself, so the same file drives both. Every step is
``[label, result]``; results are plain JSON (bytes as latin-1 text, the hostname reduced to
whether it has the ``ip:port`` form).

The sequence leaves out the places where kvpool deliberately differs from Mooncake 0.3.13
(those are tested on their own): pointers outside registered memory (Mooncake reads or
writes them, or crashes; kvpool refuses with -600), keys over 1 KiB, zero-size ``put_from``,
and ``prefer_alloc_in_same_node`` on single-buffer puts (Mooncake answers -600).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import re
import sys
from typing import Any


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": value.decode("latin-1")}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def run(module_name: str, master: str, engine_module: str) -> list[list[Any]]:
    store_module = importlib.import_module(module_name)
    engine_mod = importlib.import_module(engine_module)
    Store, ReplicateConfig = store_module.MooncakeDistributedStore, store_module.ReplicateConfig
    steps: list[list[Any]] = []

    def step(label: str, value: Any) -> Any:
        steps.append([label, _plain(value)])
        return value

    store = Store()
    step("setup positional", store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp",
                                         "", master))
    hostname = store.get_hostname()
    step("get_hostname is ip:port", bool(re.fullmatch(r"127\.0\.0\.1:\d+", hostname)))
    step("remove_all force (clean start)", store.remove_all(True) >= 0)

    # bytes API, existing keys keep their first value
    step("put", store.put("a", b"first"))
    step("put existing", store.put("a", b"second-value"))
    step("get keeps first", store.get("a"))
    step("get missing", store.get("missing"))
    step("put empty value", store.put("empty", b""))
    step("is_exist present", store.is_exist("a"))
    step("is_exist missing", store.is_exist("missing"))
    step("batch_is_exist", store.batch_is_exist(["a", "missing", "a"]))
    step("get_size", store.get_size("a"))
    step("get_size missing", store.get_size("missing"))
    step("remove while leased", store.remove("a"))
    step("remove force", store.remove("a", True))
    step("remove missing", store.remove("a"))
    for key in ("e1", "e2", "e3"):
        store.put(key, b"v")
    step("is_exist leases", [store.is_exist("e1"), store.remove("e1")])
    step("batch_is_exist leases", [store.batch_is_exist(["e2"]), store.remove("e2")])
    step("get_size leases", [store.get_size("e3"), store.remove("e3")])

    # zero-copy API over registered memory
    size = 1 << 20
    buf = ctypes.create_string_buffer(size)
    ptr = ctypes.addressof(buf)
    step("register_buffer", store.register_buffer(ptr, size))
    ctypes.memmove(ptr, b"x" * 100, 100)
    step("put_from", store.put_from("pf", ptr, 100))
    step("get_into too small", store.get_into("pf", ptr + 4096, 50))
    step("get_into", store.get_into("pf", ptr + 4096, 200))
    step("get_into bytes", ctypes.string_at(ptr + 4096, 100))
    step("get_into missing", store.get_into("missing", ptr + 4096, 200))
    ctypes.memmove(ptr, b"A" * 10 + b"B" * 20 + b"C" * 30, 60)
    step("batch_put_from", store.batch_put_from(["b1", "b2"], [ptr, ptr + 10], [10, 20]))
    step("batch_put_from existing", store.batch_put_from(["b1", "b3"], [ptr + 10, ptr + 30],
                                                         [20, 30]))
    step("batch_get_into", store.batch_get_into(
        ["b1", "b2", "missing", "b3"], [ptr + 8192, ptr + 12288, ptr + 16384, ptr + 20480],
        [100, 100, 100, 5]))
    step("batch_get_into bytes", ctypes.string_at(ptr + 8192, 10)
         + ctypes.string_at(ptr + 12288, 20))
    step("batch_get_into length mismatch", store.batch_get_into(["b1"], [ptr, ptr], [1]))
    step("batch_put_from length mismatch", store.batch_put_from(["x1", "x2"], [ptr], [1, 2]))

    # multi-buffer objects: the concatenation of the regions
    step("multi put", store.batch_put_from_multi_buffers(
        ["m1", "m2"], [[ptr, ptr + 10], [ptr + 30]], [[10, 20], [30]]))
    step("multi get", store.batch_get_into_multi_buffers(
        ["m1", "m2", "missing"], [[ptr + 24576, ptr + 28672], [ptr + 32768], [ptr + 36864]],
        [[15, 15], [30], [10]], True))
    step("multi get bytes", ctypes.string_at(ptr + 24576, 15) + ctypes.string_at(ptr + 28672, 15))
    step("multi get regions too small", store.batch_get_into_multi_buffers(
        ["m1"], [[ptr + 24576, ptr + 28672]], [[10, 10]], False))
    step("multi get regions larger", store.batch_get_into_multi_buffers(
        ["m1"], [[ptr + 24576, ptr + 28672]], [[20, 20]], False))
    step("multi put existing", store.batch_put_from_multi_buffers(["m1"], [[ptr + 100]], [[30]]))
    step("multi put no regions", store.batch_put_from_multi_buffers(["e1"], [[]], [[]]))

    # batch bytes API
    step("put_batch", store.put_batch(["pb1", "pb2"], [b"one", b"two"]))
    step("put_batch length mismatch", store.put_batch(["q1"], [b"a", b"b"]))
    step("get_batch", store.get_batch(["pb1", "missing", "pb2"]))
    step("batch_remove while leased", store.batch_remove(["pb1", "missing"]))
    step("batch_remove force", store.batch_remove(["pb1", "missing"], True))

    # bulk removal
    step("remove_by_regex force", store.remove_by_regex("^b[0-9]$", True))
    step("remove_by_regex bad pattern", store.remove_by_regex("(", True))
    step("remove_all force", store.remove_all(True))
    step("put x1", store.put("x1", b"1"))
    step("put x2", store.put("x2", b"2"))
    step("put x3", store.put("x3", b"3"))
    step("get x3 (leases it)", store.get("x3"))
    step("remove_all skips leased", store.remove_all(False))
    step("remove_all force removes the rest", store.remove_all(True))
    step("is_exist after remove_all", store.batch_is_exist(["x1", "x2", "x3", "m1"]))

    # placement wishes
    config = ReplicateConfig()
    config.preferred_segment = hostname
    step("put preferred own segment", store.put("c1", b"v", config))
    config = ReplicateConfig()
    config.prefer_alloc_in_same_node = True
    step("multi put same node", store.batch_put_from_multi_buffers(
        ["c2"], [[ptr, ptr + 10]], [[10, 10]], config))
    step("get c2", store.get("c2"))

    step("unregister_buffer", store.unregister_buffer(ptr))
    step("unregister_buffer again", store.unregister_buffer(ptr))
    step("remove_all force (clean end)", store.remove_all(True))
    step("close", store.close())
    step("close again", store.close())

    # the MindIE path: a TransferEngine, its port in the segment name, memory it registered
    engine = engine_mod.TransferEngine()
    step("engine initialize", engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", ""))
    port = engine.get_rpc_port()
    step("engine port is an int > 0", isinstance(port, int) and port > 0)
    store2 = Store()
    step("setup 8 positional with engine", store2.setup(
        f"127.0.0.1:{port}", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master,
        engine.get_engine()))
    buf2 = ctypes.create_string_buffer(b"registered on the engine", 64)
    step("engine register_memory", engine.register_memory(ctypes.addressof(buf2), 64))
    step("put_from engine memory", store2.put_from("te", ctypes.addressof(buf2), 24))
    step("get engine object", store2.get("te"))
    config = ReplicateConfig()
    config.preferred_segment = f"127.0.0.1:{port}"
    config.prefer_alloc_in_same_node = True
    step("multi put MindIE config", store2.batch_put_from_multi_buffers(
        ["mi"], [[ctypes.addressof(buf2), ctypes.addressof(buf2) + 8]], [[8, 16]], config))
    step("remove_all force (engine store)", store2.remove_all(True))
    step("close engine store", store2.close())

    # the dict form
    store3 = Store()
    step("setup dict", store3.setup({"local_hostname": "127.0.0.1",
                                     "metadata_server": "P2PHANDSHAKE",
                                     "global_segment_size": 32 << 20,
                                     "local_buffer_size": 16 << 20, "protocol": "tcp",
                                     "master_server_addr": master}))
    step("dict store put/get", [store3.put("d", b"dict"), store3.get("d")])
    step("remove_all force (dict store)", store3.remove_all(True))
    step("close dict store", store3.close())
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--module", required=True)
    parser.add_argument("--engine-module", required=True)
    parser.add_argument("--master", required=True)
    args = parser.parse_args()
    steps = run(args.module, args.master, args.engine_module)
    sys.stdout.write("RESULT " + json.dumps(steps) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

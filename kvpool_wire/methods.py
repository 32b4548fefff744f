"""The Master service's method table: one entry per RPC, derived from the proto.

Both transports carry the same protobuf messages: gRPC (path ``/kvpool.Master/<Name>``) and the
lean framing (``kvpool_wire.framing``), where a frame names its method by ``method_id``. The
table is built from the proto's service descriptor, so neither side can drift from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvpool_wire._pb import kvpool_pb2 as pb

#: Lean-framing method ids outside the service: the connection's auth frame and an error answer.
METHOD_AUTH = int(pb.METHOD_AUTH)
METHOD_ERROR = int(pb.METHOD_ERROR)
#: Largest message either side accepts unless configured otherwise.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20

#: Calls whose repetition changes nothing more than the first one did (safe to retry).
IDEMPOTENT = frozenset({"RegisterClient", "Heartbeat", "MountSegment", "GetSegments",
                        "PutStart", "GetReplicas", "Exist", "QueryPrefix", "GetStats"})


@dataclass(frozen=True, slots=True)
class RpcMethod:
    """One Master RPC: its gRPC path, lean-framing id and message types."""

    name: str
    method_id: int
    path: str
    request_type: Any
    response_type: Any
    idempotent: bool


def _rpc_methods() -> dict[str, RpcMethod]:
    service = pb.DESCRIPTOR.services_by_name["Master"]
    methods = {}
    for m in service.methods:
        snake = re.sub(r"(?<!^)(?=[A-Z])", "_", m.name).upper()
        methods[m.name] = RpcMethod(
            name=m.name, method_id=int(pb.Method.Value(f"METHOD_{snake}")),
            path=f"/{service.full_name}/{m.name}",
            request_type=getattr(pb, m.input_type.name),
            response_type=getattr(pb, m.output_type.name),
            idempotent=m.name in IDEMPOTENT)
    return methods


#: gRPC method name -> method.
RPC_METHODS: dict[str, RpcMethod] = _rpc_methods()
#: Lean-framing method id -> method.
METHODS_BY_ID: dict[int, RpcMethod] = {m.method_id: m for m in RPC_METHODS.values()}

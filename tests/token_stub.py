"""A gRPC Master stub for tests that speak raw protobuf: it remembers the client token each
registration returned and puts it into that client's later client-scoped requests (and into
its re-registrations), as a real client does. A request that already carries a token, or names
a client that never registered through a stub, is sent as it is. Stubs share one table by
default, so a client re-registering with a master restarted from ``--state-dir`` proves itself
as a real client would."""

from __future__ import annotations

from typing import Any

from kvpool_wire._pb import kvpool_pb2_grpc as pb_grpc

#: client id -> the token its latest registration returned (shared by default).
TOKENS: dict[str, bytes] = {}
_SCOPED = ("RegisterClient", "Heartbeat", "UnregisterClient", "MountSegment", "UnmountSegment",
           "PutStart", "PutEnd", "PutRevoke")


class TokenStub:
    """``pb_grpc.MasterStub`` with per-client tokens filled in (see the module docstring)."""

    def __init__(self, channel: Any, tokens: dict[str, bytes] | None = None) -> None:
        self._stub = pb_grpc.MasterStub(channel)
        self.tokens = TOKENS if tokens is None else tokens

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        if name not in _SCOPED:
            return method

        def call(request: Any, *args: Any, **kwargs: Any) -> Any:
            client_id = request.client_id
            if not request.client_token and client_id in self.tokens:
                request.client_token = self.tokens[client_id]
            reply = method(request, *args, **kwargs)
            if name == "RegisterClient" and reply.client_token:
                self.tokens[client_id] = reply.client_token
            return reply
        return call

"""How a stub reaches the master, shared by the asyncio and the blocking stub: addresses,
TLS, the master's local Unix socket, gRPC channel settings, and the retry policy.

Deadlines and retries: every call has a deadline (``timeout_s``, counted over all of its
attempts) and never hangs. Transport failures become ``KVPoolError(RPC_FAILED)`` (``TIMEOUT``
when the deadline passed); idempotent calls are retried a bounded number of times inside the
deadline, and any call whose request never left this process (``NotSent``) may be retried.
"""

from __future__ import annotations

import socket
import ssl
import struct
from pathlib import Path
from typing import Any

import grpc

from kvpool_client.rpc.session import TlsConfig
from kvpool_wire.methods import RpcMethod
from kvpool_wire.status import KVPoolError, Status

#: After the lean port could not be reached, calls use gRPC for this long before trying again.
LEAN_RETRY_AFTER_S = 1.0
#: gRPC reconnects to a master that went away: first after this, then backing off to at most
#: the next (see ``grpc_channel_args``).
INITIAL_RECONNECT_BACKOFF_MS = 250
MAX_RECONNECT_BACKOFF_MS = 2000
MAX_ATTEMPTS = 3
_RETRY_STATUSES = frozenset({Status.RPC_FAILED, Status.RESOURCE_EXHAUSTED})

GRPC_TO_STATUS = {
    grpc.StatusCode.UNAVAILABLE: Status.RPC_FAILED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Status.TIMEOUT,
    grpc.StatusCode.UNAUTHENTICATED: Status.PERMISSION_DENIED,
    grpc.StatusCode.PERMISSION_DENIED: Status.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Status.RESOURCE_EXHAUSTED,
    grpc.StatusCode.INVALID_ARGUMENT: Status.INVALID_ARGUMENT,
    grpc.StatusCode.CANCELLED: Status.RPC_FAILED,
}


class NotSent(KVPoolError):
    """The request never left this process (connection refused): safe to retry any call."""


def retry_backoff_s(method: RpcMethod, error: KVPoolError, attempt: int, now_s: float,
                    deadline_s: float) -> float | None:
    """How long to wait before attempt ``attempt + 1`` after ``error``, or None: give up."""
    retry = isinstance(error, NotSent) or (method.idempotent and error.status in _RETRY_STATUSES)
    backoff_s = 0.05 * (1 << attempt)
    if not retry or attempt == MAX_ATTEMPTS - 1 or now_s + backoff_s >= deadline_s:
        return None
    return backoff_s


def final_error(method: RpcMethod, error: KVPoolError) -> KVPoolError:
    """The error a call that gave up raises."""
    return KVPoolError(error.status, f"{method.name}: {error.message}")


def grpc_error(code: grpc.StatusCode, details: str | None) -> KVPoolError:
    """The KVPoolError of a failed gRPC call."""
    return KVPoolError(GRPC_TO_STATUS.get(code, Status.RPC_FAILED), f"gRPC {code.name}: {details}")


def ssl_context(tls: TlsConfig) -> ssl.SSLContext:
    """The client's TLS context for the lean port."""
    context = ssl.create_default_context(cafile=tls.ca_path or None)
    if tls.cert_path:
        context.load_cert_chain(tls.cert_path, tls.key_path or None)
    return context


def grpc_channel_args(tls: TlsConfig | None, max_message_bytes: int
                      ) -> tuple[Any, list[tuple[str, int]]]:
    """(channel credentials, or None for an insecure channel; channel options).

    Reconnects back off to at most ``MAX_RECONNECT_BACKOFF_MS``: gRPC's own ceiling is two
    minutes, and after the master was away (a restart restoring millions of objects takes
    tens of seconds) a client would come back only that much later, past the grace its
    restored segments have to be remounted in."""
    options = [("grpc.max_send_message_length", max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.initial_reconnect_backoff_ms", INITIAL_RECONNECT_BACKOFF_MS),
               ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]
    if tls is None:
        return None, options
    ca, key, cert = (Path(p).read_bytes() if p else None
                     for p in (tls.ca_path, tls.key_path, tls.cert_path))
    return grpc.ssl_channel_credentials(ca, key, cert), options


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def connect_local(name: str, expected_pid: int) -> socket.socket | None:
    """A connected socket to the master's abstract Unix socket ``name``, or None when it
    cannot be reached from here (another host or network namespace, no such socket) or the
    process serving it is not the master that advertised it (pid ``expected_pid``)."""
    if not name or not expected_pid or not hasattr(socket, "SO_PEERCRED"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.connect("\0" + name)
        pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                     _PEERCRED.size))
    except OSError:
        sock.close()
        return None
    if pid != expected_pid:
        sock.close()
        return None
    return sock


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``host:port`` (``[v6]:port`` too). Raises ValueError."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"master address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)

"""Master stubs: the only client code that sends Master calls.

- ``session``: what all stubs of one client share (token, master clock) and every call by name.
- ``aio``: the asyncio stub (``MasterRpc``); ``blocking``: the blocking stub
  (``BlockingMasterRpc``), which runs each call on the calling thread.
- ``endpoints``: addresses, TLS, the master's local socket, deadlines and retries.
- ``lean_blocking``: one lean-framing connection driven by blocking socket calls.
"""

from kvpool_client.rpc.aio import MasterRpc
from kvpool_client.rpc.blocking import BlockingMasterRpc
from kvpool_client.rpc.session import (
    ClientIdTaken,
    MasterCalls,
    MasterSession,
    Registration,
    TlsConfig,
)

__all__ = ["BlockingMasterRpc", "ClientIdTaken", "MasterCalls", "MasterRpc", "MasterSession",
           "Registration", "TlsConfig"]

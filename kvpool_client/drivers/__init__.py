"""Drivers run the core's plans (``kvpool_client.core``) against real I/O.

- ``blocking``: everything on the caller's thread: the blocking master stub, shared-memory
  copies (the caller takes part in large ones), blocking TCP. The sync client's calls.
- ``aio``: on an event loop: the asyncio master stub, large batches cut into pipelined
  sub-batches, copies on worker threads, asyncio TCP, commits sent without waiting. The async
  client, async writes, and the sync client's calls that need the loop.
- ``parts``: what both drivers of one client share (segment directory, shared memory, checks,
  the caller-moved copy strategy).
"""

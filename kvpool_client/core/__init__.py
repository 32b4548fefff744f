"""The client's pure data-path core: no sockets, no event loop, no threads, no clock of its own
(``now`` is passed in). Drivers (``kvpool_client.drivers``) run its plans.

- ``keys``: one normalisation of a batch's keys, with the one duplicate-key policy.
- ``put_plan``: a batch write from ``PutStart`` answers to copy jobs to commit or revoke.
- ``read_plan``: a batch read from ``GetReplicas`` answers to copy attempts to checked results.
"""

"""kvpool's published contract, shared by the master and every client: domain types, status
codes, the protobuf messages and the method table, the one translation between them, the lean
framing and capabilities. It imports nothing of ``kvpool_master`` or ``kvpool_client``; a
client in another language implements what is here (and ``proto/kvpool.proto``).
"""

"""Replaying a serving workload through the whole stack, as ``kvhex run`` does.

``workload`` builds requests (a synthetic multi-turn chat, or a JSONL file) and hashes their
tokens as an engine does; ``driver`` plays an engine's scheduler and worker against an
``OffloadEngine`` and a ``BlockTransfer`` over a device KV cache, checking every loaded
block, and returns a ``RunReport``.
"""

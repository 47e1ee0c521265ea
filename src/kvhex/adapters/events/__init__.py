"""What leaves kvhex as KV events (``kvhex.sinks``: ZMQ, JSONL, structlog) and the wire codec
byte-compatible with vLLM's."""

__all__: list[str] = []

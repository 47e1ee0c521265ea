"""Adapters driven by kvhex (torch, fsspec, NIXL, ZMQ, Prometheus): what
kvhex calls, each declared as an entry point. What calls kvhex (the command, vLLM) lives in
kvhex.cli and kvhex.vllm.

Heavy imports stay inside each adapter module; importing this package imports none of them.
"""

__all__: list[str] = []

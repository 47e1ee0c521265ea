"""Technology adapters (torch, fsspec, NIXL, ZMQ, vLLM), each declared as an entry point.

Heavy imports stay inside each adapter module; importing this package imports none of them.
"""

__all__: list[str] = []

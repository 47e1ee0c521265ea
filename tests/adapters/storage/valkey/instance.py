"""Another kvhex instance on the same Valkey pool, run as its own process by the sharing
tests: ``python -m tests.adapters.storage.valkey.instance ACTION URL CHUNKS BASE [N]``.

``put`` stores the blocks of ``request("other", CHUNKS, BASE)`` (records kept), ``get`` reads
them and checks every byte (exit 1 naming a key served wrong or not at all), ``delete``
removes the first ``N`` of them. Payloads are ``block_payload(key, SLOT)``."""

from __future__ import annotations

import sys

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.testing import block_payload
from tests.adapters.storage.peer_kit import get, put, request, started

SLOT = 4096
NS = {"model": "tiny-llama", "dtype": "float16"}
CAPACITY = 1 << 24


def main(action: str, url: str, chunks: int, base: int, n: int = 0) -> int:
    ctx, keys = request("other", chunks, base=base)
    host = MemoryHostBuffer(len(keys), SLOT)
    store = started(ValkeyTierStore(host, url, capacity_bytes=CAPACITY, namespace=NS))
    try:
        slots = list(range(len(keys)))
        if action == "put":
            for slot, key in enumerate(keys):
                host.slot_view(slot)[:] = block_payload(key, SLOT)
            result = put(store, keys, ctx, slots)
            if not result.success:
                print(f"put failed: {result.error}")
                return 1
        elif action == "get":
            result = get(store, keys, slots)
            if not result.success:
                print(f"get failed: {result.error}")
                return 1
            for slot, key in enumerate(keys):
                if bytes(host.slot_view(slot)) != block_payload(key, SLOT):
                    print(f"served wrong: {key.hex()}")
                    return 1
        elif action == "delete":
            store.delete(keys[:n])
            store.drain()
            store.poll()
        else:
            print(f"unknown action {action}")
            return 2
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    action, url, chunks, base, *rest = sys.argv[1:]
    sys.exit(main(action, url, int(chunks), int(base), *map(int, rest)))

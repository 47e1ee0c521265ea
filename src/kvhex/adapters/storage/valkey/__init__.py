"""The Valkey tier: blocks in a Valkey (Redis-protocol) server or cluster, one key per block
(:mod:`kvhex.adapters.storage.valkey.tier`)."""

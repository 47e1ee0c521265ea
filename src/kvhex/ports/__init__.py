"""Ports: the small ``typing.Protocol`` boundaries between the service and technology.

Each port lives in its own module, speaks only domain types, and documents per method who
calls it, from which thread, whether it blocks, who owns buffers and what it raises. The
eviction-policy boundary lives in :mod:`kvhex.domain.policies.base` because the pure primary
tier itself drives it; the IO ports (tier storage, device transfer, host buffer, event sink)
are added here as the service gains them.
"""

__all__: list[str] = []

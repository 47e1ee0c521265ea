"""Metrics adapters: an engine's counters exported to a monitoring system (``prometheus``)."""

__all__: list[str] = []

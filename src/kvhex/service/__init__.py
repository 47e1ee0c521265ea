"""Orchestration over ports (tiering manager, event pipeline, engine facade); no IO of its own."""

__all__: list[str] = []

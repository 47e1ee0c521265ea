"""Local file tiers: slab files of block slots, their shared SQLite index, and the read-only
check behind ``kvhex fsck``."""

__all__: list[str] = []

"""Local file tiers: slab files of block slots, the slot tables that index them, and the read-only
check behind ``kvhex fsck``."""

__all__: list[str] = []

"""Persistent secondary tiers (``kvhex.tiers``): the block format, the tier bookkeeping over
the domain's residency core, local files (``files/``: slabs, their index, fsck), object stores
(``objects``) and NIXL (``nixl``)."""

__all__: list[str] = []

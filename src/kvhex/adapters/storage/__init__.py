"""Persistent secondary tiers (``kvhex.tiers``): the block format (``format``), the tier
bookkeeping over the domain's residency core (``tier``) and the seam its data paths plug into
(``block_io``), a tier's root and namespace opened (``namespace``), local files (``files/``:
slabs, their POSIX mover, fsck), object stores (``objects/``), and the two tiers built from
them: ``fsspec`` (any fsspec URL) and ``nixl`` (NIXL's POSIX and OBJ backends)."""

__all__: list[str] = []

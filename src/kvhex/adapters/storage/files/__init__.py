"""Local file tiers: slab files of block slots (``slabs``), the slot tables that index them
(``_index``), the mover that copies blocks in and out of their slots (``posix``, on its
native data path where it was built: ``_native``), and the read-only check behind
``kvhex fsck`` (``fsck``)."""

"""Object-store tiers: one object per block through fsspec (s3fs for S3).

``io`` (:class:`~kvhex.adapters.storage.objects.io.ObjectIo`: the namespace, its listing and
the block checks), ``mover`` (the default mover: s3fs batches), ``s3_direct`` (the reads of
an S3-compatible endpoint straight into the host slots) and ``_errors`` (what a failed
store call means, named as its cause)."""

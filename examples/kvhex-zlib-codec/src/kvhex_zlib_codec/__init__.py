"""A kvhex block codec: DEFLATE through the standard library's zlib (docs/plugins.md)."""

from kvhex_zlib_codec.codec import ZlibCodec

__all__ = ["ZlibCodec"]

"""kvhex-counting-transfer: a kvhex device <-> host transfer that counts what it moves.

Declared as the ``kvhex.transfers`` entry point ``counting``; select it with
``[run] transfer = "counting"`` (or ``kvhex run --transfer counting``) and, to keep the
counts, ``transfer_options = { report_path = "counts.json" }``.
"""

from kvhex_counting_transfer.transfer import CountingBlockTransfer, Counts

__all__ = ["CountingBlockTransfer", "Counts"]

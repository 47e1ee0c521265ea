"""Argument types shared by the subcommands: argparse names the flag in every error."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["positive"]


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse ``type`` accepting numbers of ``kind`` above 0."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    return parse

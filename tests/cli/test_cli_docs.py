"""docs/cli.md documents every flag of the tiers, events, fsck and bench commands."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvhex.cli import build_parser

DOC = Path(__file__).parent.parent.parent / "docs" / "cli.md"


def section(command: str) -> str:
    text = DOC.read_text()
    found = re.search(rf"^## kvhex {command}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"docs/cli.md has no '## kvhex {command}' section"
    return found.group(1)


def flags(command: str) -> set[str]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser = sub.choices[command]
    return {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    } | {action.metavar for action in parser._actions if not action.option_strings}


@pytest.mark.parametrize("command", ["tiers", "events", "fsck", "bench"])
def test_every_flag_is_documented(command: str) -> None:
    text = section(command)
    missing = sorted(f for f in flags(command) if f"`{f}" not in text)
    assert missing == []

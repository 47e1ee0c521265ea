"""docs/cli.md documents every flag of every command, the common flags and the exit
statuses the commands use."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from kvhex.cli import ORDER, build_parser
from kvhex.cli._args import EXIT_FAILED, EXIT_NOTHING, EXIT_OK, EXIT_USAGE

DOC = Path(__file__).parent.parent.parent / "docs" / "cli.md"
COMMON = {"--verbose", "--log-format"}
"""Every subcommand takes these too; they are documented once, at the top."""


def section(title: str) -> str:
    text = DOC.read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert found, f"docs/cli.md has no '## {title}' section"
    return found.group(1)


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    } | {str(action.metavar) for action in parser._actions if not action.option_strings}


def subcommand(command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = sub.choices[command]
    return parser


@pytest.mark.parametrize("command", ORDER)
def test_every_flag_is_documented(command: str) -> None:
    text = section(f"kvhex {command}")
    missing = sorted(f for f in options(subcommand(command)) - COMMON if f"`{f}" not in text)
    assert missing == []


def test_the_common_flags_and_exit_statuses_are_documented() -> None:
    text = section("Common flags, logging and exit status")
    top = options(build_parser()) - {"COMMAND"}
    assert top == COMMON | {"--version"}
    assert sorted(f for f in top if f"`{f}" not in text) == []
    statuses = re.findall(r"^\| (\d) \|", text, re.M)
    assert statuses == [str(s) for s in (EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOTHING)]

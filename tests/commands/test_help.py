"""``relax --help`` and every command's ``--help`` read as plain text: no reST markup from the
docstrings they are drawn from."""

from __future__ import annotations

import argparse
import re

from relax_core.cli import build_parser

MARKUP = re.compile(r"``|:(?:func|class|mod|meth|data|attr):`")


def _helps() -> dict[str, str]:
    parser = build_parser()
    helps = {"relax": parser.format_help()}
    for action in parser._subparsers._group_actions:  # argparse keeps sub-parsers only here
        assert isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items():
            helps[f"relax {name}"] = sub.format_help()
    return helps


def test_no_help_text_shows_rest_markup() -> None:
    helps = _helps()
    assert {"relax", "relax run", "relax serve", "relax plan"} <= set(helps)
    shown = {name: MARKUP.findall(text) for name, text in helps.items()}
    assert {name: found for name, found in shown.items() if found} == {}

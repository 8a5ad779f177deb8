"""docs/flags.md documents exactly the flags of overlap_tp's argument group, each with its default as parsed."""
import argparse
import os
import re

from overlap_tp.megatron.arguments import add_overlap_args

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "flags.md")


def _flags():
    parser = add_overlap_args(argparse.ArgumentParser())
    return {action.option_strings[0]: action for action in parser._actions
            if action.option_strings and action.option_strings[0] not in ("-h", "--help")}


def _documented():
    """flag -> the table row's default cell, from every row of docs/flags.md's tables."""
    rows = {}
    with open(DOC) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            found = re.match(r"`(--[a-z-]+)", cells[0]) if len(cells) == 3 else None
            if found:
                rows[found.group(1)] = cells[1]
    return rows


def test_every_flag_is_documented_once_and_no_other():
    assert sorted(_documented()) == sorted(_flags())


def test_documented_choices_and_plain_defaults_match_the_parser():
    documented = _documented()
    with open(DOC) as f:
        text = f.read()
    for flag, action in _flags().items():
        if action.choices:
            assert f"`{flag} {{{','.join(action.choices)}}}`" in text, flag
        if isinstance(action.default, str) and action.choices:   # the switches with a named default
            assert documented[flag] == action.default, (flag, documented[flag], action.default)

"""The `mmspec` command line: `mmspec <command> ...` and `mmspec train <model> ...`.

Subcommands are listed in `mmspec.cli.registry` and imported lazily.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mmspec.cli.registry import COMMANDS, CONVERT_COMMANDS, TRAIN_COMMANDS
from mmspec.errors import MMSpecError


def _load(module_name: str):
    return importlib.import_module(module_name)


def _add_lazy(subparsers, name: str, module_name: str, help_text: str, argv_has: bool):
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(_module=module_name)
    if argv_has:  # only import the module whose command is being run (or whose --help is asked)
        _load(module_name).add_arguments(parser)
    return parser


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmspec",
        description="Speculative and collaborative decoding for multimodal generation.",
    )
    from mmspec import __version__

    parser.add_argument("--version", action="version", version=f"mmspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (module, help_text) in COMMANDS.items():
        _add_lazy(sub, name, module, help_text, argv_has=name in argv[:1])
    for group, commands, help_text in (
            ("train", TRAIN_COMMANDS, "train the embedded-world models and drafters (they ship in assets/)"),
            ("convert", CONVERT_COMMANDS, "convert official checkpoints into pipeline folders")):
        group_parser = sub.add_parser(group, help=help_text, description=help_text)
        group_sub = group_parser.add_subparsers(dest=f"{group}_command", metavar="<model>")
        for name, (module, command_help) in commands.items():
            _add_lazy(group_sub, name, module, command_help, argv_has=argv[:1] == [group] and name in argv[1:2])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module_name = getattr(args, "_module", None)
    if module_name is None:
        parser.print_help()
        return 0 if not argv else 2
    try:
        return int(_load(module_name).run(args) or 0)
    except MMSpecError as err:
        print(f"mmspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmspec: interrupted", file=sys.stderr)
        return 130

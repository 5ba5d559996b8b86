"""The `mmspec` command line: `mmspec <command> ...` and `mmspec train <model> ...`.

Subcommands are found by `mmspec.cli.registry` (the core's own, and the families' entry points) and imported
lazily.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from mmspec.cli.registry import GROUPS, all_commands, command_help
from mmspec.errors import MMSpecError


def _load(module_name: str):
    return importlib.import_module(module_name)


def _add_lazy(subparsers, name: str, module_name: str, argv_has: bool, wants_help: bool = False):
    help_text = command_help(module_name)
    parser = subparsers.add_parser(name, help=help_text, description=help_text,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(_module=module_name)
    if argv_has:  # only import the module whose command is being run (or whose --help is asked)
        module = _load(module_name)
        module.add_arguments(parser)
        if wants_help and hasattr(module, "help_epilog"):  # text that costs imports: only for --help
            parser.epilog = module.help_epilog()
    return parser


GROUP_HELP = {"train": "train the embedded-world models and drafters (they ship in assets/)",
              "convert": "convert official checkpoints into pipeline folders"}


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmspec",
        description="Speculative and collaborative decoding for multimodal generation.",
    )
    from mmspec import __version__

    parser.add_argument("--version", action="version", version=f"mmspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    commands = all_commands()
    wants_help = "-h" in argv or "--help" in argv
    for name, module in commands.items():
        if "." not in name:
            _add_lazy(sub, name, module, argv_has=name in argv[:1], wants_help=wants_help)
    for group in GROUPS:
        group_parser = sub.add_parser(group, help=GROUP_HELP[group], description=GROUP_HELP[group])
        group_sub = group_parser.add_subparsers(dest=f"{group}_command", metavar="<model>")
        for name, module in sorted(commands.items()):
            prefix, _, model = name.partition(".")
            if prefix == group:
                _add_lazy(group_sub, model, module, argv_has=argv[:1] == [group] and model in argv[1:2],
                          wants_help=wants_help)
    return parser


def show_library_notes() -> None:
    """The library's INFO messages (logger "mmspec": e.g. a draft budget timing its options on a first call) on
    stderr, as the command line's own notes; the library itself is silent unless its user configures logging."""
    logger = logging.getLogger("mmspec")
    if not any(getattr(h, "mmspec_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.setLevel(logging.INFO)
        handler.mmspec_cli = True
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    module_name = getattr(args, "_module", None)
    if module_name is None:
        parser.print_help()
        return 0 if not argv else 2
    show_library_notes()
    try:
        return int(_load(module_name).run(args) or 0)
    except MMSpecError as err:
        print(f"mmspec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mmspec: interrupted", file=sys.stderr)
        return 130
    finally:  # a command launched in several processes leaves its group before the interpreter exits, error or not
        if "torch.distributed" in sys.modules:  # (torch stays unimported for --help and light commands)
            from mmspec.processes import end_processes

            end_processes()

"""Where the `mmspec` command finds its subcommands.

Each command is a module that defines `add_arguments(parser)` and `run(args) -> int`. The core's own commands are
listed here; the families' (`mmspec vlm`, `mmspec train llamagen`, `mmspec convert mar`, ...) come from the
entry-point group `mmspec.commands` of the installed distributions (pyproject.toml: `"train.llamagen" =
"image_ar.llamagen.train"`, `"vlm" = "vlm.cli"`), so the core names no family. A command's one-line help is the
first sentence of its module docstring after "`mmspec ...`: ", read from the source file without importing it:
modules are imported only when their command runs (or its --help is asked), so `mmspec --help` stays fast and one
broken optional dependency does not break every command.
"""

from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import entry_points
from pathlib import Path

ENTRY_POINT_GROUP = "mmspec.commands"
GROUPS = ("train", "convert")  # `mmspec train <model>`, `mmspec convert <model>`

# the core's commands: name -> module (group commands as "group.name")
CORE_COMMANDS: dict[str, str] = {
    "selfcheck": "mmspec.cli.selfcheck",
    "generate": "mmspec.cli.generate",
    "bench": "mmspec.bench.cli",
    "profile": "mmspec.cli.profile",
    "train.tokenizer": "mmspec.data.train_tokenizer",
    "train.judge": "mmspec.metrics.train_judge",
}


def module_file(module: str) -> Path | None:
    """The source file of a dotted module name, found without importing its packages (None if not found)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        path = Path(base, *rest)
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def command_help(module: str) -> str:
    """The first sentence of the module's docstring after its "`mmspec ...`: " prefix."""
    path = module_file(module)
    doc = (ast.get_docstring(ast.parse(path.read_text())) or "") if path else ""
    text = " ".join(doc.split("\n\n")[0].split())
    if text.startswith("`") and "`: " in text:
        text = text.split("`: ", 1)[1]
    end = text.find(". ")
    return text if end < 0 else text[:end]


def all_commands() -> dict[str, str]:
    """Every command name ("generate", "train.llamagen", ...) -> its module: the core's, then the entry points'."""
    commands = dict(CORE_COMMANDS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        commands.setdefault(ep.name, ep.value)
    return commands

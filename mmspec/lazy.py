"""Package exports imported on first use (PEP 562), so that importing a family's record or a command's module does
not import every pipeline of its package (and with them diffusers and transformers).

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"LlamaGenPipeline": "image_ar.llamagen.pipeline"})

Glossary: *exports* = {public name: the module that defines it}; an `(module, attribute)` pair exports an
attribute under another name (`"GPT_PRESETS": ("image_ar.llamagen.gpt", "PRESETS")`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str | tuple[str, str]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The module-level `__getattr__` and `__dir__` of `package` that import each export on its first use and keep
    it in the package's namespace (later lookups are plain attribute reads), and its `__all__` (the exports'
    names, sorted)."""

    def __getattr__(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module_name, attribute = (source, name) if isinstance(source, str) else source
        value = getattr(importlib.import_module(module_name), attribute)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__, sorted(exports)

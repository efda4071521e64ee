"""A served name that is another module's name, as torch 2.15 re-exports it: the very object, looked up
when first used (so that a patch serving the original serves both)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def reexport(module: str, name: str) -> Callable[[], Any]:
    """The factory of ``Patch.symbol`` that serves ``module.name`` itself under another module."""

    def factory() -> Any:
        return getattr(importlib.import_module(module), name)

    return factory

"""Finding patches: the built-in catalogue (``torchpatch.patches``) and third-party entry points."""

from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
from types import ModuleType
from typing import Iterable, List

from ._patch import Patch

ENTRY_POINT_GROUP = "torchpatch.patches"
log = logging.getLogger("torchpatch")


def _patches_in(obj: object) -> List[Patch]:
    """A Patch, an iterable of Patches, or a module whose ``PATCH``/``PATCHES`` holds them."""
    if isinstance(obj, Patch):
        return [obj]
    if isinstance(obj, ModuleType):
        found: List[Patch] = []
        for attr in ("PATCH", "PATCHES"):
            if hasattr(obj, attr):
                found += _patches_in(getattr(obj, attr))
        return found
    if isinstance(obj, (list, tuple)):
        return [p for item in obj for p in _patches_in(item)]
    raise TypeError(f"not a torchpatch Patch: {obj!r}")


def builtin_patches() -> List[Patch]:
    from . import patches as catalogue

    found: List[Patch] = []
    for info in sorted(pkgutil.iter_modules(catalogue.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{catalogue.__name__}.{info.name}")
        found += _patches_in(module)
    return found


def _entry_points() -> Iterable[object]:
    if sys.version_info >= (3, 10):
        from importlib.metadata import entry_points
    else:
        from importlib_metadata import entry_points
    return entry_points(group=ENTRY_POINT_GROUP)


def plugin_patches(strict: bool = False) -> List[Patch]:
    """Patches that other distributions register under the ``torchpatch.patches`` entry points."""
    found: List[Patch] = []
    for ep in _entry_points():
        try:
            found += _patches_in(ep.load())  # type: ignore[attr-defined]
        except Exception as exc:
            if strict:
                raise
            log.warning("skipping third-party patches from entry point %r: %s", ep, exc)
    return found


def all_patches(strict: bool = False) -> List[Patch]:
    """Built-in then third-party patches; a duplicate id is an error in the plugin, not ours."""
    patches = builtin_patches()
    seen = {p.id for p in patches}
    for p in plugin_patches(strict):
        if p.id in seen:
            log.warning("ignoring third-party patch %r: the id is already taken", p.id)
            continue
        seen.add(p.id)
        patches.append(p)
    return patches

"""Finding patches: the built-in catalogue (``torchpatch.patches``) and third-party entry points."""

from __future__ import annotations

import importlib
import json
import logging
import os
import pkgutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

from ._patch import Patch

ENTRY_POINT_GROUP = "torchpatch.patches"
DATA = "_data"  # the catalogue's data folder: the index, inventories, relocations, known bugs
INDEX = "index.json"  # in the catalogue's data: module -> {patch id: [torch specifier, python specifier]}
log = logging.getLogger("torchpatch")


def _patches_in(obj: object) -> List[Patch]:
    """A Patch, an iterable of Patches, or a module whose ``PATCH``/``PATCHES`` holds them (a
    Patch in both counts once)."""
    if isinstance(obj, Patch):
        return [obj]
    if isinstance(obj, ModuleType):
        found: List[Patch] = []
        for attr in ("PATCH", "PATCHES"):
            if hasattr(obj, attr):
                found += [p for p in _patches_in(getattr(obj, attr)) if not any(p is q for q in found)]
        return found
    if isinstance(obj, (list, tuple)):
        return [p for item in obj for p in _patches_in(item)]
    raise TypeError(f"not a torchpatch Patch: {obj!r}")


def catalogue_modules() -> List[str]:
    """The names of the catalogue's patch modules, ``<subsystem>.<module>`` under ``torchpatch.patches``
    (one folder per torch subsystem; ``_``-prefixed folders and modules are helpers and data), sorted."""
    from . import patches as catalogue

    return sorted(f"{folder.name}.{m.name}" for folder in pkgutil.iter_modules(catalogue.__path__)
                  if folder.ispkg and not folder.name.startswith("_")
                  for m in pkgutil.iter_modules([os.path.join(catalogue.__path__[0], folder.name)])
                  if not m.ispkg and not m.name.startswith("_"))


def _load(names: Iterable[str]) -> List[Patch]:
    return [p for name in names for p in _patches_in(importlib.import_module(f"{__package__}.patches.{name}"))]


def builtin_patches() -> List[Patch]:
    """Every patch of the catalogue (imports every patch module)."""
    return _load(catalogue_modules())


def catalogue_data() -> Path:
    """The folder of the catalogue's data (``torchpatch/patches/_data``)."""
    from . import patches as catalogue

    return Path(catalogue.__path__[0], DATA)


def catalogue_index() -> Dict[str, Dict[str, List[str]]]:
    """Module name -> {patch id: [torch specifier, python specifier]}, as ``tools/patch_table.py
    --write`` recorded it from the modules (a test keeps the two in step); empty if absent."""
    try:
        with open(catalogue_data() / INDEX, encoding="utf-8") as f:
            return json.load(f)
    except OSError:
        return {}


def catalogue_ranges() -> Dict[str, str]:
    """Patch id -> its torch specifier, for every catalogue patch, from the index (no module imported)."""
    return {patch_id: specs[0] for declared in catalogue_index().values() for patch_id, specs in declared.items()}


def applicable_builtin_patches(applies: Callable[[str, str], bool]) -> Tuple[List[Patch], List[str]]:
    """The catalogue's patches, importing only the modules that declare a patch for which
    ``applies(torch_specifier, python_specifier)`` holds, and the ids of the patches left out.
    A module the index does not know (a patch added since the index was written) is imported."""
    index = catalogue_index()
    names: List[str] = []
    skipped: List[str] = []
    for name in catalogue_modules():
        declared = index.get(name)
        if declared and not any(applies(torch, python) for torch, python in declared.values()):
            skipped += declared
        else:
            names.append(name)
    return _load(names), skipped


def _entry_points() -> Iterable[object]:
    if sys.version_info >= (3, 10):
        from importlib.metadata import entry_points
    else:
        from importlib_metadata import entry_points
    return entry_points(group=ENTRY_POINT_GROUP)


def _named(ep: object) -> str:
    """An entry point as its distribution declares it."""
    return f"entry point {ep.name} = {ep.value}"  # type: ignore[attr-defined]


class PluginError(RuntimeError):
    """A third-party patch distribution is broken and ``TORCHPATCH_STRICT=1`` asked for an error."""


def plugin_patches(strict: bool = False) -> List[Tuple[object, Patch]]:
    """Patches that other distributions register under the ``torchpatch.patches`` entry points,
    each with its entry point. A plugin that fails to load, ``sys.exit()`` included, is skipped with
    a warning, or fails activation under ``strict``; it never ends the job by itself (a
    ``KeyboardInterrupt`` still does)."""
    found: List[Tuple[object, Patch]] = []
    for ep in _entry_points():
        try:
            found += [(ep, p) for p in _patches_in(ep.load())]  # type: ignore[attr-defined]
        except (Exception, SystemExit) as exc:
            why = f"it called sys.exit({exc.code!r}) while loading" if isinstance(exc, SystemExit) else str(exc)
            if strict and isinstance(exc, SystemExit):
                raise PluginError(f"third-party patches from {_named(ep)}: {why}") from exc
            if strict:
                raise
            log.warning("skipping third-party patches from %s: %s", _named(ep), why)
    return found


def all_patches(strict: bool = False) -> List[Patch]:
    """Built-in then third-party patches."""
    return with_plugins(builtin_patches(), strict)


def with_plugins(builtin: List[Patch], strict: bool = False, taken: Sequence[str] = ()) -> List[Patch]:
    """``builtin`` then third-party patches; a plugin reusing an id (of ``builtin`` or ``taken``)
    is an error in the plugin, not ours: a warning, or a PluginError under ``strict``."""
    patches = list(builtin)
    seen = {p.id for p in patches} | set(taken)
    for ep, p in plugin_patches(strict):
        if p.id in seen:
            message = f"third-party patch {p.id!r} from {_named(ep)}: the id is already taken"
            if strict:
                raise PluginError(message)
            log.warning("ignoring %s", message)
            continue
        seen.add(p.id)
        patches.append(p)
    return patches

"""What exists on an inventoried torch: the files ``tools/inventory.py`` writes to
``patches/_data/inventory`` (modules and their names, failing imports, members of torch.distributed's
classes), and the view that answers the resolver's questions from one of them."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from .. import _versions
from .._registry import catalogue_data
from .base import ATTR, MISSING, MODULE, UNKNOWN, Lookup


def inventory_files() -> Dict[str, Path]:
    """Inventoried torch versions (release strings) and their files, oldest first."""
    found = {p.name[len("torch-"):-len(".json.gz")]: p for p in (catalogue_data() / "inventory").glob("torch-*.json.gz")}
    return dict(sorted(found.items(), key=lambda kv: _versions.release(kv[0]) or ()))


class Inventory:
    """One torch version's inventory: every module of the walked packages with its names, and
    (in inventories taken since members were recorded) the members of torch.distributed's classes."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.version: str = data["torch"]
        self.python: str = data.get("python", "?")
        self.modules: Dict[str, Dict[str, str]] = data["modules"]
        self.failing: Dict[str, str] = data["failing"]
        # module -> its ``__all__`` (inventories taken since it was recorded; modules that define one)
        self.exports: Dict[str, List[str]] = data.get("exports", {})
        self.walked: Tuple[str, ...] = tuple(data.get("walked", ()))
        self.walk_skips: Set[str] = set(data.get("walk_skips", ()))
        # "module:qualname" -> {"members": [...], "init": "(self, ...)" | None, "extends": [base, ...]}
        self.classes: Dict[str, Dict[str, Any]] = data.get("classes", {})
        self.bases: Dict[str, List[str]] = data.get("bases", {})
        self._members: Dict[str, FrozenSet[str]] = {}

    @classmethod
    @functools.lru_cache(maxsize=None)
    def load(cls, path: Path) -> "Inventory":
        return cls(json.loads(gzip.decompress(path.read_bytes())))

    @classmethod
    def empty(cls, version: str) -> "Inventory":
        return cls({"torch": version, "modules": {}, "failing": {}})

    def walked_whole(self, module: str) -> bool:
        """Whether every submodule of ``module`` would be listed (its package was walked)."""
        return any(module == root or module.startswith(root + ".") for root in self.walked) and not (
            self.walk_skips.intersection(module.split(".")))

    def attribute_kind(self, module: str, name: str) -> Optional[str]:
        """MODULE or ATTR where this inventory knows ``module.name``, else None."""
        full = f"{module}.{name}"
        if full in self.modules or full in self.failing:
            return MODULE
        value = self.modules.get(module, {}).get(name)
        return None if value is None else MODULE if value == "<module>" else ATTR

    def members(self, key: str) -> FrozenSet[str]:
        """Every member of class ``key``: its own and those of the big bases it extends."""
        if key not in self._members:
            entry = self.classes[key]
            found = set(entry["members"])
            for base in entry.get("extends", ()):
                found.update(self.bases.get(base, ()))
            self._members[key] = frozenset(found)
        return self._members[key]


@functools.lru_cache(maxsize=None)
def all_inventories() -> Tuple[Inventory, ...]:
    """Every inventory of the catalogue, oldest first."""
    return tuple(Inventory.load(p) for p in inventory_files().values())


class InventoryView:
    """What exists on an inventoried torch. ``others`` (every inventory) tell a name that is
    absent here but known elsewhere (missing) from one nobody looked at (unknown)."""

    def __init__(self, inv: Inventory, others: Sequence[Inventory]) -> None:
        self.inv = inv
        self.others = others
        self.label = f"torch {inv.version}'s inventory"

    def child(self, module: str, name: str) -> Lookup:
        inv, full = self.inv, f"{module}.{name}"
        if module in inv.failing:
            return UNKNOWN, "", self._failed(module)
        if full in inv.modules:
            return MODULE, full, ""
        if full in inv.failing:
            return UNKNOWN, "", self._failed(full)
        names = inv.modules.get(module)
        if names is None:
            return UNKNOWN, "", f"{module} is not in {self.label}"
        value = names.get(name)
        if value is not None:
            return (MODULE, full, "") if value == "<module>" else (ATTR, "", "")
        if inv.walked_whole(module) and name not in inv.walk_skips:
            return MISSING, "", ""
        if any(o.attribute_kind(module, name) == ATTR for o in self.others):
            return MISSING, "", ""  # an attribute elsewhere, so not a submodule that was not looked at
        return UNKNOWN, "", f"{module} was not walked for submodules in {self.label}"

    def op(self, namespace: str, name: str) -> Lookup:
        return UNKNOWN, "", f"{self.label} has no operator list: needs a live torch"

    def start(self) -> None:
        pass  # nothing to start: the inventory is read already

    def close(self) -> None:
        pass

    def _failed(self, module: str) -> str:
        return (f"{module} failed to import when {self.label} was taken (Python {self.inv.python}): "
                f"{self.inv.failing[module]}")

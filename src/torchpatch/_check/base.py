"""What every part of ``torchpatch check`` shares: the kinds of answers and rows, the catalogue's
data files, and the result of resolving one name."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .._registry import catalogue_data

ROOT = "torch"
OPS = "torch.ops"
# What a view says about ``module.name``; what a resolver says about a whole name.
MODULE, ATTR, MISSING, UNKNOWN = "module", "attr", "missing", "unknown"
# The kinds of rows, in report order.
NATIVE, PATCHED, UNRESOLVED, GUARDED = "native", "patched", "unresolved", "guarded"
KINDS = (UNRESOLVED, GUARDED, UNKNOWN, PATCHED, NATIVE)

Lookup = Tuple[str, str, str]  # (MODULE | ATTR | MISSING | UNKNOWN, real module name for MODULE, note)


class CheckError(RuntimeError):
    """The check cannot go on (a helper that hangs); the message says what to do."""


@dataclass(frozen=True)
class Result:
    """One name (or member, or call) resolved on the target torch."""

    status: str  # NATIVE | PATCHED | MISSING | UNKNOWN
    key: str  # the name the row is about: cut after the first attribute, missing or undecided part
    patches: Tuple[str, ...] = ()
    how: Tuple[str, ...] = ()
    note: str = ""


@functools.lru_cache(maxsize=None)
def not_backportable() -> List[Dict[str, str]]:
    """The entries of ``patches/_data/not_backportable.json``: features torchpatch cannot serve."""
    data = json.loads((catalogue_data() / "not_backportable.json").read_text())
    return list(data["entries"])


def not_backportable_for(name: str) -> Optional[Dict[str, str]]:
    for entry in not_backportable():
        if name == entry["name"] or name.startswith(entry["name"] + "."):
            return entry
    return None

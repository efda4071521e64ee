"""Which torch ``torchpatch check`` checks against (``--torch``, or the installed one), and where
what exists there comes from: its inventory, a helper that imports it, or both."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .. import _versions
from .inventory import Inventory, InventoryView, all_inventories, inventory_files
from .live import LayeredView, LiveView, answer_timeout


@dataclass
class Target:
    version: str  # the release checked against
    installed: Optional[str]
    source: str  # words: where what exists comes from
    view: Any  # answers child() and op() questions
    inventory: Inventory  # its classes' members (an empty inventory where there is none)
    shim_view: Optional[LiveView] = None  # the installed torch with torchpatch on: what shims hold

    def start(self) -> None:
        """Start importing the installed torch now, where it will be asked, so that it runs while
        the files are scanned."""
        self.view.start()

    def start_shims(self) -> None:
        """Likewise for the installed torch with torchpatch on (the names shims hold)."""
        if self.shim_view is not None:
            self.shim_view.start()

    def close(self) -> None:
        self.view.close()
        if self.shim_view is not None:
            self.shim_view.close()


# what --torch accepts: a release (each number 10 digits at most), a pre-, post- or dev-release, a local part
_VERSION = re.compile(r"v?\d{1,10}(?:\.\d{1,10})*(?:(?:a|b|rc)\d{1,10})?(?:\.post\d{1,10})?(?:\.dev\d{1,10})?"
                      r"(?:\+[A-Za-z0-9.]{1,64})?")


def pick_version(requested: str, installed: Optional[str], inventoried: Sequence[str]) -> str:
    """The release ``--torch requested`` means: ``X.Y.Z`` exactly, ``X.Y`` the newest ``X.Y.*``
    inventoried or installed; ValueError naming the known ones otherwise (a text that is no version,
    ``2.x`` or ``1e5``; one that names no single release, ``2``)."""
    known = f"installed {installed or 'none'}; inventoried {', '.join(inventoried) or 'none'}"
    if not _VERSION.fullmatch(requested.strip()):
        shown = requested if len(requested) <= 40 else requested[:37] + "..."
        raise ValueError(f"--torch {shown!r} is not a torch version: give X.Y (the newest release of that minor) or"
                         f" X.Y.Z ({known})")
    wanted = _versions.release(requested) or ()
    if len(wanted) == 1:
        raise ValueError(f"--torch {requested!r} is ambiguous: name a minor, X.Y (its newest release), or a"
                         f" release, X.Y.Z ({known})")
    if len(wanted) not in (2, 3):
        raise ValueError(f"--torch {requested!r}: give X.Y (the newest release of that minor) or X.Y.Z ({known})")
    candidates = set(inventoried).union([installed] if installed else [])
    matching = [v for v in candidates if (_versions.release(v) or ())[:len(wanted)] == wanted]
    if not matching:
        raise ValueError(f"torch {requested} is neither installed nor inventoried: {known}")
    return max(matching, key=lambda v: _versions.release(v) or ())


def choose_target(requested: Optional[str], live: bool) -> Target:
    """The torch to check against; ValueError with the reason if there is none."""
    installed = _versions.torch_version()
    inventories = inventory_files()
    base = ".".join(map(str, _versions.release(installed) or ())) if installed else None
    if requested is not None:  # "" too: an error, never the installed torch by default
        version = pick_version(requested, base, list(inventories))
    elif base:
        version = base
    else:
        raise ValueError(f"torch is not installed here: pass --torch VERSION (inventoried: {', '.join(inventories)})")
    inv = Inventory.load(inventories[version]) if version in inventories else Inventory.empty(version)
    inv_view = InventoryView(inv, all_inventories())
    if version != base:
        return Target(version, installed, f"torch {version} from its inventory (not installed)", inv_view, inv)
    if not live:
        how = "from its inventory" if version in inventories else "no inventory"
        return Target(version, installed, f"installed torch {installed}, {how} (--no-import)", inv_view, inv)
    answer_timeout()  # a bad TORCHPATCH_CHECK_TIMEOUT fails here, before the scan
    if version in inventories:
        return Target(version, installed, f"installed torch {installed}, from its inventory and a live import where needed",
                      LayeredView(inv_view, LiveView()), inv, LiveView(patched=True))
    return Target(version, installed, f"installed torch {installed}, by importing it (no inventory of {version})",
                  LiveView(), inv, LiveView(patched=True))

"""Known silent-correctness bugs of torch releases, and whether this process fixes them.

The bugs are catalogue data (``patches/_data/silent_bugs.json``): each entry names the upstream fix,
and the catalogue patch that fixes it or why none can. The torch versions a bug affects are its patch's
(the patch's ``Patch(torch=...)``), or the entry's own ``torch`` where no patch fixes it or torch fixed it
before the patch's range ends (a patch that fixes several bugs). ``torchpatch doctor`` lists those of the
installed torch with their state under the process's ``TORCHPATCH*`` variables.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

from . import _versions
from ._plan import PatchPlan
from ._registry import catalogue_data, catalogue_ranges

FILE = "silent_bugs.json"


def entries() -> List[Dict[str, Any]]:
    """Every entry of ``patches/_data/silent_bugs.json``, as the file holds it."""
    data = json.loads((catalogue_data() / FILE).read_text())
    return list(data["entries"])


def with_range(entry: Dict[str, Any], patch_torch: Mapping[str, str]) -> Dict[str, Any]:
    """``entry`` with the torch versions the bug affects, ``torch``: the entry's own where it has one,
    else its patch's, from ``patch_torch`` (patch id -> the patch's torch specifier)."""
    return entry if "torch" in entry else dict(entry, torch=patch_torch[entry["patch"]])


@functools.lru_cache(maxsize=None)
def known_bugs() -> List[Dict[str, Any]]:
    """Every known bug, with the torch versions it affects (the patches' from the catalogue index)."""
    patch_torch = catalogue_ranges()
    return [with_range(entry, patch_torch) for entry in entries()]


def _state(entry: Dict[str, Any], plans: Dict[str, PatchPlan], on: bool) -> Dict[str, Any]:
    """Whether ``entry`` is fixed in this configuration, and what to do where it is not."""
    patch_id: Optional[str] = entry.get("patch")
    if patch_id is None:
        return {"fixed": False, "why": f"no patch can fix it: {entry['not_fixable']}"}
    p = plans.get(patch_id)
    if p is None:
        return {"fixed": False, "why": f"patch {patch_id} is not in this catalogue"}
    if not p.applies:
        return {"fixed": False, "why": f"patch {patch_id} does not apply here ({p.applies_reason})"}
    if not p.decision.enabled:
        return {"fixed": False, "why": f"patch {patch_id} is switched off ({p.decision.reason})"}
    if not on:
        return {"fixed": False, "why": f"torchpatch is off: set TORCHPATCH=1 (patch {patch_id} fixes it)"}
    return {"fixed": True, "why": f"fixed by patch {patch_id}"}


def known_bugs_for(torch: Optional[str], plans: Sequence[PatchPlan], on: bool) -> List[Dict[str, Any]]:
    """The known bugs of ``torch`` (none when torch is not installed), each with ``fixed`` and
    ``why``; ``on`` says whether torchpatch is on in this configuration (``TORCHPATCH=1``)."""
    if not torch:
        return []
    by_id = {p.patch.id: p for p in plans}
    return [dict(entry, **_state(entry, by_id, on)) for entry in known_bugs()
            if _versions.matches(entry["torch"], torch)]

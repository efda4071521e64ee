"""What one installation has done so far, as a read-only snapshot: what the summary line,
``torchpatch.status()`` and the report (``TORCHPATCH_REPORT``) say."""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Tuple

# A patch's status: a patch once applied (or failed) stays so.
APPLIED, NOT_NEEDED, FAILED, WAITING = "applied", "not needed", "failed", "waiting for its module"


class Outcome(NamedTuple):
    """One installation's state at one moment; its dicts are copies, the caller's to keep."""

    started: float  # time.time() at install()
    status: Dict[str, str]  # armed patch id -> APPLIED, NOT_NEEDED, FAILED or WAITING
    errors: Dict[str, str]  # failed patch id -> why it failed
    switched_off: Dict[str, str]  # patch id -> why: patches that apply here but the flags switched off
    served_modules: Dict[str, Tuple[str, str]]  # module -> (patch id, the real module's name for an alias else "")
    served_symbols: Dict[str, str]  # "module.name" -> patch id: served symbols made so far

    def with_status(self, wanted: str) -> List[str]:
        """The ids of the patches whose status is ``wanted``, sorted."""
        return sorted(i for i, s in self.status.items() if s == wanted)

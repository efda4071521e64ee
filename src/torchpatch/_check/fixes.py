"""``torchpatch explain`` on an error a patch fixes (``Patch(errors=...)``, read from the generated
``patches/_data/patch_errors.json``): which patch, and whether it acts on the chosen torch with this
shell's switches: on (by default or by a flag), switched off (by which flag), or not for this torch
(the versions it applies to). Matched in messages and logs beside the known errors of
``known_errors.json``, in the same shape (an entry with ``patterns``), so that a log's scan finds both.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, List, Sequence, Tuple

from _torchpatch_startup import parse_flag

from .._config import Config
from .._fixes import patch_errors
from .._patch import Patch
from .serving import Serving

PATCH_ERROR = "patch error"  # the form of the answer, beside "known error"
# verdict -> exit status: the patch acts here (0), or not (1)
VERDICTS = {"fixed here": 0, "switched off": 1, "not for this torch": 1}


@functools.lru_cache(maxsize=None)
def fix_entries() -> Tuple[Dict[str, Any], ...]:
    """One entry per patch with errors, shaped like a known error's (``id`` is the patch's)."""
    return tuple({"id": pid, "kind": PATCH_ERROR, "patterns": e["patterns"], "torch": e["torch"],
                  "summary": e["summary"], "upstream": e["upstream"], "examples": e["examples"], "patches": [pid]}
                 for pid, e in patch_errors().items())


def fix_report(entry: Dict[str, Any], details: List[str], torch: str, text: str, state: Dict[str, Any]) -> Dict[str, Any]:
    """The answer about an error the patch of ``entry`` fixes, on ``torch`` (``state``: :func:`patch_state`'s)."""
    pid = entry["id"]
    torchpatch_on = parse_flag(os.environ.get("TORCHPATCH", "")) is True
    if not state["applies"]:
        verdict = "not for this torch"
        remedy = (f"{pid} applies to torch {entry['torch']}, not to torch {torch}: on another torch the error "
                  "has another cause, or --torch names the torch that raised it")
    elif state["enabled"]:
        verdict = "fixed here"
        remedy = ("run the job with TORCHPATCH=1 (this shell does not set it) or `torchpatch run -- CMD`"
                  if not torchpatch_on else "it acts with TORCHPATCH=1; if the error stays, `torchpatch doctor` "
                  "tells whether torchpatch is active in the job's interpreter")
    else:
        verdict = "switched off"
        remedy = f"turn {pid} back on (off here: {state['state'].split(': ', 1)[-1]}) and run with TORCHPATCH=1"
    return {
        "query": text,
        "form": PATCH_ERROR,
        "id": pid,
        "torch": torch,
        "verdict": verdict,
        "patch": pid,
        "applies_to": entry["torch"],
        "state": state["state"],
        "summary": entry["summary"],
        "remedy": remedy,
        "upstream": entry["upstream"],
        "details": details,
        "patches": [state],
        "torchpatch_on": torchpatch_on,
        "exit": VERDICTS[verdict],
    }


def format_fix(report: Dict[str, Any], indent: str = "") -> List[str]:
    """The lines for people about an error a patch fixes."""
    where = {"fixed here": f"on torch {report['torch']}", "switched off": f"on torch {report['torch']}, but it is off here",
             "not for this torch": f"on torch {report['applies_to']}, not on torch {report['torch']}"}[report["verdict"]]
    lines = [f"torchpatch explain: an error patch {report['patch']} fixes {where}",
             f"  read from    {report['query'][:300]}",
             f"  patch        {report['patch']}: {report['summary']}",
             f"  state        {report['state']}"]
    if report["details"]:
        lines.append(f"  it names     {', '.join(report['details'])}")
    lines += [f"  remedy       {report['remedy']}", f"  upstream     {report['upstream']}"]
    return [indent + line for line in lines]


def patch_state(patch_id: str, torch: str, patches: Sequence[Patch], serving: Serving) -> Dict[str, Any]:
    """Whether the patch ``patch_id`` applies to ``torch`` and whether this shell's switches have it on
    (``serving``: the catalogue on ``torch`` with them)."""
    spec = next((p.torch for p in patches if p.id == patch_id), None)
    decision = serving.decisions.get(patch_id)
    if decision is None:
        state = f"not for torch {torch}: it applies to torch {spec}"
    elif decision.enabled:
        state = f"on here ({decision.reason}); it acts in processes started with TORCHPATCH=1"
    else:
        state = f"off here: {decision.reason}"
    return {"patch": patch_id, "torch": spec, "applies": decision is not None,
            "enabled": bool(decision and decision.enabled), "state": state}


def report_for(entry: Dict[str, Any], details: List[str], torch: str, text: str, patches: Sequence[Patch],
               cfg: Config) -> Dict[str, Any]:
    """The answer about the known error or patch error of ``entry`` on ``torch``."""
    from .logs import known_report

    serving = Serving.for_torch(torch, patches, cfg)
    states = [patch_state(pid, torch, patches, serving) for pid in entry["patches"]]
    if entry.get("kind") == PATCH_ERROR:
        return fix_report(entry, details, torch, text, states[0])
    return known_report(entry, details, torch, text, states)

"""dcp-older-state-keys: ``dcp.load`` of a checkpoint an older torch saved, where a newer torch's
optimizer or LR scheduler state has entries the older one did not write, torch 2.4 and later.

What breaks:   a run saved by one torch and resumed on a newer one (the cluster image upgraded
               mid-run, a month-old checkpoint fine-tuned on this month's torch) dies in ``dcp.load``
               before reading a tensor: ``RuntimeError: Missing key in checkpoint state_dict:
               optim.param_groups.0.decoupled_weight_decay.`` (AdamW or Adam saved on torch < 2.7),
               ``... lr_scheduler._is_initial.`` (a scheduler saved on torch < 2.7),
               ``... optim.param_groups.0.fused.`` (SGD saved on torch < 2.3); inside ``dcp.load``
               on several ranks, each rank's ``CheckpointException`` carries it. DCP asks the
               checkpoint for exactly the keys of the state dict it loads into, and the newer
               torch's ``state_dict()`` has these entries; ``torch.load`` + ``load_state_dict`` of the
               same older state dict works, because each class's ``load_state_dict`` fills what an
               older state dict lacks.
Torch:         loaders 2.4 and later, 2.15 included (the key-per-entry flattening of lists that
               torch 2.4's DCP brought makes each param group's entry a key of its own);
               ``_data/state_dict_additions.json`` lists the entries, the torch that added each and
               the value an older state dict gets, measured on the state dicts of every torch of
               the matrix.
Fix:           where the default load planner's plan fails on missing keys (torch's own check
               raised), the keys that are such an entry (their path ends as a listed one, their
               value is no tensor) are left out of the load, in the flattened state dict and in the
               nested one the caller holds, and the plan is made again: the objects'
               ``load_state_dict`` then gets the older state dict as the older torch wrote it, and
               gives each entry the older torch's behaviour as torch itself does for it
               (``Adam``: ``decoupled_weight_decay=False``, ``AdamW``: True, ``SGD``: not fused, a
               scheduler's ``_is_initial``: False, as after a step). Where any other key is missing
               too, a tensor among them, nothing is changed: torch's own error, on every rank. A plan that
               succeeds is not touched; ``allow_partial_load=True`` loads skip missing keys
               natively and are not touched either.
Upstream:      https://github.com/pytorch/pytorch/issues/146157 (open: "AdamW refactoring broke
               checkpoint reloading with DCP")
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-older-state-keys",
    summary="dcp.load resumes checkpoints an older torch saved: optimizer/scheduler entries a newer torch added are filled as load_state_dict fills them",
    torch=">=2.4",
    upstream="https://github.com/pytorch/pytorch/issues/146157",
    behaviour="dcp.load of an optimizer or LR scheduler state that an older torch saved",
)

ADDITIONS = json.loads((Path(__file__).parent.parent / "_data" / "state_dict_additions.json").read_text())
# The end of a flattened key (dot-separated) that is a listed entry: "*" stands for one or more parts, a
# param group's index ("param_groups.0.fused") or, in the flattened optimizer state dicts of
# get_optimizer_state_dict(flatten_optimizer_state_dict=True), its parameter's name ("param_groups.w.fused").
ADDED_KEY = re.compile("|".join(
    r"(?:^|\.)" + r"\.".join(r"[^.]+(?:\.[^.]+)*" if part == "*" else re.escape(part)
                               for part in entry["path"].split(".")) + "$"
    for entry in ADDITIONS["entries"]))


def is_added_entry(fqn: str, value: Any) -> bool:
    """Whether the flattened state-dict entry ``fqn`` is one a newer torch added (a listed path, no tensor)."""
    import torch

    return not torch.is_tensor(value) and ADDED_KEY.search(fqn) is not None


def _drop(planner: Any, fqns: List[str]) -> None:
    """Leave ``fqns`` out of the planner's state dict and, where it flattened it, the caller's nested one."""
    mappings: Dict[str, Tuple[Any, ...]] = getattr(planner, "mappings", None) or {}
    for fqn in fqns:
        path = mappings.get(fqn) if getattr(planner, "flatten_state_dict", False) else None
        if path:
            parent = planner.original_state_dict
            for key in path[:-1]:
                parent = parent[key]
            del parent[path[-1]]
            mappings.pop(fqn)
        planner.state_dict.pop(fqn)


def _only_added_entries_missing(planner: Any) -> List[str]:
    """The keys the checkpoint lacks, where each is an entry a newer torch added; else none."""
    saved = planner.metadata.state_dict_metadata
    missing = {fqn: value for fqn, value in planner.state_dict.items() if fqn not in saved}
    return list(missing) if all(is_added_entry(fqn, value) for fqn, value in missing.items()) else []


def _plan_without_added_entries(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    try:
        return wrapped(*args, **kwargs)
    except RuntimeError as exc:
        if "Missing key in checkpoint state_dict" not in str(exc):
            raise
        # the state dict the plan was made from (after any re-flattening for a checkpoint of torch < 2.4)
        missing = _only_added_entries_missing(instance)
        if not missing:
            raise  # another key is missing too: torch's own error, nothing changed
    _drop(instance, missing)
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.distributed.checkpoint.default_planner")
def leave_added_entries_to_load_state_dict(patcher: Patcher, planner: ModuleType) -> bool:
    patcher.wrap(planner.DefaultLoadPlanner, "create_local_plan", _plan_without_added_entries)
    return True

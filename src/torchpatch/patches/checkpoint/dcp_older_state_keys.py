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
               raised) and each missing key is such an entry (its flattened key ends as a listed
               path, its value is no tensor), each gets, in the state dict the caller holds, the
               value torch's own ``load_state_dict`` gives a state dict that lacks it (``older_value``
               in the data: ``decoupled_weight_decay`` False, as ``Adam`` sets it, and ``AdamW``'s
               ``__setstate__`` then sets its True; SGD's ``fused`` False; a scheduler's
               ``_is_initial`` False, as after a step); the entries are left out of the plan, which
               is made again. Filled rather than left out: the flattened optimizer state dicts of
               ``get_optimizer_state_dict(flatten_optimizer_state_dict=True)`` (torchtitan's) need
               every entry of this torch's param groups to unflatten. Where any other key is missing
               too, a tensor among them, nothing is changed: torch's own error, on every rank. A
               plan that succeeds is not touched, nor one with ``allow_partial_load=True`` (missing
               keys skipped natively) or ``flatten_state_dict=False``.
Upstream:      https://github.com/pytorch/pytorch/issues/146157 (open: "AdamW refactoring broke
               checkpoint reloading with DCP")
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Pattern, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-older-state-keys",
    summary="dcp.load resumes checkpoints an older torch saved: optimizer/scheduler entries a newer torch added "
            "get the values load_state_dict gives an older state",
    torch=">=2.4",
    upstream="https://github.com/pytorch/pytorch/issues/146157",
    behaviour="dcp.load of an optimizer or LR scheduler state that an older torch saved",
)

ADDITIONS = json.loads((Path(__file__).parent.parent / "_data" / "state_dict_additions.json").read_text())


def _pattern(path: str) -> str:
    """The regular expression of a flattened key that ends as ``path``: "*" stands for one or more parts,
    a param group's index ("param_groups.0.fused") or, in the flattened optimizer state dicts of
    get_optimizer_state_dict(flatten_optimizer_state_dict=True), its parameter's name ("param_groups.w.fused")."""
    parts = (r"[^.]+(?:\.[^.]+)*" if part == "*" else re.escape(part) for part in path.split("."))
    return r"(?:^|\.)" + r"\.".join(parts) + "$"


# (the end of a flattened key, the value an older state gets) for each listed entry
ENTRIES: List[Tuple[Pattern[str], Any]] = [(re.compile(_pattern(entry["path"])), entry["older_value"])
                                           for entry in ADDITIONS["entries"]]


def older_value(fqn: str, value: Any) -> Tuple[bool, Any]:
    """Whether the flattened state-dict entry ``fqn`` (no tensor) is one a newer torch added, and the
    value an older state gets for it."""
    import torch

    if not torch.is_tensor(value):
        for pattern, older in ENTRIES:
            if pattern.search(fqn):
                return True, older
    return False, None


def _fill(planner: Any, missing: Dict[str, Any]) -> None:
    """Give each of ``missing`` its older value in the caller's state dict and leave it out of the plan."""
    from torch.distributed.checkpoint._traverse import set_element

    for fqn, value in missing.items():
        set_element(planner.original_state_dict, planner.mappings.pop(fqn), value)
        planner.state_dict.pop(fqn)


def _only_added_entries_missing(planner: Any) -> Dict[str, Any]:
    """The keys the checkpoint lacks with their older values, where each is an entry a newer torch added;
    else none."""
    saved = planner.metadata.state_dict_metadata
    missing = {fqn: older_value(fqn, value) for fqn, value in planner.state_dict.items() if fqn not in saved}
    if not all(added for added, _ in missing.values()):
        return {}
    return {fqn: value for fqn, (_, value) in missing.items()}


def _plan_with_older_values(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    try:
        return wrapped(*args, **kwargs)
    except RuntimeError as exc:
        if "Missing key in checkpoint state_dict" not in str(exc) or not getattr(instance, "flatten_state_dict", False):
            raise
        # the state dict the plan was made from (after any re-flattening for a checkpoint of torch < 2.4)
        missing = _only_added_entries_missing(instance)
        if not missing:
            raise  # another key is missing too: torch's own error, nothing changed
    _fill(instance, missing)
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.distributed.checkpoint.default_planner")
def fill_added_entries(patcher: Patcher, planner: ModuleType) -> bool:
    patcher.wrap(planner.DefaultLoadPlanner, "create_local_plan", _plan_with_older_values)
    return True

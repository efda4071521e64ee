"""dcp-pre-2-4-checkpoints: torch 2.4's ``dcp.load`` reads checkpoints that torch 2.3 and older saved.

What breaks:   a checkpoint saved by torch 2.1-2.3 whose state holds a dict without tensors (a
               scheduler's state, a data loader's position, a trainer's config) fails to load on
               torch 2.4.x: ``RuntimeError: Missing key in checkpoint state_dict: loop.data.epoch.``
               (inside ``dcp.load`` each rank's ``CheckpointException`` carries it). Torch 2.1-2.3
               saved such a dict whole, under one key (``loop.data``); torch 2.4 flattens every dict
               down to its leaves and asks for ``loop.data.epoch``, which the older checkpoint has
               not. Torch 2.5 and later load both layouts.
Torch:         2.4 (pytorch#125335 flattened every dict; pytorch#134158, torch 2.5, made the default
               load planner fall back to the older layout).
Fix:           as torch 2.5 does: where the checkpoint has keys the state dict's flattening does not
               give, the default load planner flattens the caller's state dict as torch 2.3 did
               (a dict or list none of whose values holds a tensor is one entry) and, where that
               gives keys the checkpoint has, plans the load from it. A checkpoint of torch 2.4 and
               later, or one whose keys match anyway, is planned as before.
Upstream:      https://github.com/pytorch/pytorch/pull/134158 (issue
               https://github.com/pytorch/pytorch/issues/133923)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-pre-2-4-checkpoints",
    summary="torch 2.4's dcp.load reads checkpoints of torch 2.3 and older (dicts without tensors saved whole)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/134158",
    behaviour="dcp.load of a checkpoint that torch 2.3 or older saved",
)


def flatten_as_torch_2_3(state_dict: Dict[str, Any], holds_tensor: Any) -> Tuple[Dict[str, Any], Dict[str, Tuple[Any, ...]]]:
    """``state_dict`` flattened as torch 2.1-2.3's DCP did: a dict or list in which no value (at any
    depth) is a tensor (``holds_tensor``) is one entry; the keys joined by dots, the paths kept."""
    flattened: Dict[str, Any] = {}
    mappings: Dict[str, Tuple[Any, ...]] = {}

    def terminal(value: Any) -> bool:
        if isinstance(value, Mapping):
            values = list(value.values())
        elif isinstance(value, list):
            values = value
        else:
            return True
        return not any(holds_tensor(v) or isinstance(v, (Mapping, list)) and not terminal(v) for v in values)

    def visit(path: Tuple[Any, ...], value: Any) -> None:
        if terminal(value):
            fqn = ".".join(map(str, path))
            if fqn in flattened:
                raise ValueError(f"duplicated flatten key {fqn}")
            flattened[fqn], mappings[fqn] = value, path
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(path + (str(key),), item)
        else:
            for index, item in enumerate(value):
                visit(path + (index,), item)

    for key, value in state_dict.items():
        visit((str(key),), value)
    return flattened, mappings


def _plan_older_layout(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if getattr(instance, "flatten_state_dict", False) and instance.metadata is not None:
        from torch.distributed.checkpoint._traverse import _keep_visiting_tensors

        saved = set(instance.metadata.state_dict_metadata)
        if saved - set(instance.state_dict):
            older, mappings = flatten_as_torch_2_3(instance.original_state_dict, _keep_visiting_tensors)
            if saved & (set(older) - set(instance.state_dict)):
                instance.state_dict, instance.mappings = older, mappings
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.distributed.checkpoint.default_planner")
def load_older_layout(patcher: Patcher, planner: ModuleType) -> bool:
    from torch.distributed.checkpoint import _nested_dict

    if hasattr(_nested_dict, "traverse_state_dict_v_2_3") or hasattr(planner, "_version"):
        return False  # torch 2.5+: the planner falls back to the older layout itself
    patcher.wrap(planner.DefaultLoadPlanner, "create_local_plan", _plan_older_layout)
    return True

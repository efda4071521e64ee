"""optim-load-keeps-param-names: ``Optimizer.load_state_dict`` keeps each group's ``param_names``
when the loaded groups carry none, on torch 2.4-2.5.

What breaks:   torchtitan 0.3 names its optimizer's parameters (``{"params": [...], "param_names":
               [...]}`` per group) and checkpoints the optimizer keyed by those names, loading it back
               through a state dict whose groups have no ``param_names``. Torch 2.4 replaces each group
               with the loaded one, names gone: the next checkpoint after a resume dies with
               ``ValueError: Optimizer must be built with (name, param) tuples so that param_names is
               available for FQN-keyed state dicts.``
Torch:         2.4-2.5; torch 2.6 (named parameters in optimizers) keeps a group's ``param_names``
               where the loaded group has none.
Fix:           as torch 2.6's ``load_state_dict``: after this torch's own load, a group whose loaded
               state had no ``param_names`` gets back the ones it had before (groups matched in order,
               as the load matches them). A loaded group with its own ``param_names`` keeps those.
Upstream:      https://github.com/pytorch/pytorch/pull/134107
"""

from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

from torchpatch import Error, Patch, Patcher

from .._source import torch_source

PATCH = Patch(
    id="optim-load-keeps-param-names",
    summary="Optimizer.load_state_dict keeps each group's param_names when the loaded groups carry none",
    torch=">=2.4,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/134107",
    behaviour="optimizer.load_state_dict(sd) with param_names in the optimizer's groups, not in sd's",
    errors=(
        Error(r"Optimizer must be built with \(name, param\) tuples so that param_names is available",
              "ValueError: Optimizer must be built with (name, param) tuples so that param_names is available "
              "for FQN-keyed state dicts."),
    ),
)


def _load_state_dict(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    names: List[Optional[Any]] = [group.get("param_names") for group in instance.param_groups]
    result = wrapped(*args, **kwargs)
    for group, had in zip(instance.param_groups, names):
        if had is not None and "param_names" not in group:
            group["param_names"] = had
    return result


@PATCH.on_import("torch.optim.optimizer")
def keep_param_names(patcher: Patcher, optimizer: ModuleType) -> bool:
    if '"param_names"' in torch_source(optimizer.Optimizer.load_state_dict):
        return False  # torch 2.6+: its own load keeps them
    patcher.wrap(optimizer.Optimizer, "load_state_dict", _load_state_dict)
    return True

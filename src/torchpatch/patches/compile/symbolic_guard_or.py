"""symbolic-guard-or: ``torch.fx.experimental.symbolic_shapes.guard_or_false`` / ``guard_or_true``,
torch 2.4-2.6.

What breaks:   torchtitan 0.3.0's RoPE (``torchtitan.models.common.rope``, imported by every model)
               does ``from torch.fx.experimental.symbolic_shapes import guard_or_false``: on torch 2.4
               ``ImportError: cannot import name 'guard_or_false'``.
Torch:         2.7 added both: a plain ``bool`` is returned as it is; a ``SymBool`` is guarded on (its
               value under the shape environment, recording a guard), and where that needs an unbacked
               (data-dependent) value the default (False / True) is returned instead of raising.
Fix:           serve both with that behaviour from this torch's ``guard_bool``: the default is returned
               where it raises ``GuardOnDataDependentSymNode``. (2.15 also honours its
               ``backed_size_oblivious`` switch, which these torches do not have.) Where torch has them,
               nothing is set.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/fx/experimental/symbolic_shapes.py
"""

from types import ModuleType
from typing import Any

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="symbolic-guard-or",
    summary="torch.fx.experimental.symbolic_shapes.guard_or_false / guard_or_true (torch 2.7's): guard a SymBool, "
            "the default where it is data-dependent",
    torch=">=2.4,<2.7",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/fx/experimental/symbolic_shapes.py",
)
HOME = "torch.fx.experimental.symbolic_shapes"
PATCH.sets(HOME, ("guard_or_false", "guard_or_true"))


def _guard_or(value: Any, default: bool) -> bool:
    import torch
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, guard_bool

    if not isinstance(value, torch.SymBool):
        if not isinstance(value, bool):
            raise AssertionError(f"Expected bool, got {type(value)}")
        return value
    try:
        return guard_bool(value)
    except GuardOnDataDependentSymNode:
        return default


def guard_or_false(a: Any) -> bool:
    """Try to guard ``a``; if that needs a data-dependent value, return False."""
    return _guard_or(a, False)


def guard_or_true(a: Any) -> bool:
    """Try to guard ``a``; if that needs a data-dependent value, return True."""
    return _guard_or(a, True)


@PATCH.on_import(HOME)
def serve(patcher: Patcher, module: ModuleType) -> bool:
    missing = [f for f in (guard_or_false, guard_or_true) if not hasattr(module, f.__name__)]
    for function in missing:
        function.__module__ = HOME
        patcher.setattr(module, function.__name__, function)
    return bool(missing)

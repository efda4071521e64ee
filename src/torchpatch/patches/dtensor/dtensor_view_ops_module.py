"""dtensor-view-ops-module: ``torch.distributed.tensor._ops._view_ops``'s view decomposition
(``view_groups``, ``infer_size``, the ``DimSpec`` classes) on torch 2.4.

What breaks:   the spmd_types package (0.2.3; torchtitan 0.3.0 imports it everywhere) imports
               ``from torch.distributed.tensor._ops._view_ops import infer_size, InputDim, Split,
               view_groups`` in its type checker: on torch 2.4 ``ModuleNotFoundError: No module named
               'torch.distributed.tensor._ops'``.
Torch:         2.4 has the module as ``torch.distributed._tensor.ops.view_ops``; 2.5 moved it. The whole
               module is not an alias (``relocations`` leaves it out): its sharding helpers changed
               signatures (``dim_flatten``, ``propagate_shape_and_sharding``). The view decomposition
               did not: for concrete sizes 2.4's ``view_groups`` and ``infer_size`` return what 2.15's
               return (2.15 adds symbolic-size guards and ``torch._check`` for the asserts), and the
               ``DimSpec`` dataclasses hold the same fields (2.15's ``InputDim`` refuses ``==`` with a
               non-``DimSpec``, a guard against a caller's bug).
Fix:           serve ``torch.distributed.tensor._ops`` (a package holding only this module) and
               ``torch.distributed.tensor._ops._view_ops`` with 2.4's very ``view_groups``,
               ``infer_size`` and ``DimSpec`` classes; its sharding helpers are not served.
Upstream:      https://github.com/pytorch/pytorch/pull/133881 (DTensor's modules moved under
               torch.distributed.tensor, torch 2.5)
"""

from types import ModuleType

from torchpatch import Patch

PATCH = Patch(
    id="dtensor-view-ops-module",
    summary="torch.distributed.tensor._ops._view_ops on torch 2.4: view_groups, infer_size and the DimSpec "
            "classes (the view decomposition), 2.4's own",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/133881",
)

NAMES = ("DimSpec", "DimMap", "Singleton", "InputDim", "Broadcast", "NewDim", "Repeat", "Flatten", "Split",
         "Shape", "infer_size", "view_groups")
PATCH.sets("torch.distributed.tensor._ops._view_ops", NAMES)


@PATCH.module("torch.distributed.tensor._ops")
def build_package(module: ModuleType) -> None:
    """The package only holds the served ``_view_ops``."""
    module.__all__ = []


@PATCH.module("torch.distributed.tensor._ops._view_ops")
def build(module: ModuleType) -> None:
    from torch.distributed._tensor.ops import view_ops

    for name in NAMES:
        setattr(module, name, getattr(view_ops, name))
    module.__all__ = []

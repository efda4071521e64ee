"""processgroup-deepcopy: ``copy.deepcopy`` / ``copy.copy`` of objects that hold a ProcessGroup, torch
1.13 and later.

What breaks:   ``ema = deepcopy(model)`` where the model keeps its sequence-parallel group as an
               attribute (Open-Sora) fails with
               ``TypeError: cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object``.
Torch:         every version from 1.13 to 2.13 (a ProcessGroup has no ``__deepcopy__``).
Fix:           give the C++ ProcessGroup and Backend classes ``__deepcopy__``/``__copy__`` that
               return the group itself: a communicator is a handle to shared state, so a copy
               shares it and everything else in the object graph is copied as usual. Defining the
               methods on the classes (rather than wrapping ``copy.deepcopy``) also covers groups
               reached through dicts, lists and tuples, whose copy helpers bind the original
               ``deepcopy`` as a default argument, and every backend subclass. Pickling a group
               still fails: save a ``state_dict`` instead.
Upstream:      not fixed in torch: https://github.com/pytorch/pytorch/issues/76927 (open); the
               Open-Sora report: https://github.com/hpcaitech/Open-Sora/issues/49
"""

from types import ModuleType
from typing import Any, Dict, Optional

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="processgroup-deepcopy",
    summary="deepcopy/copy of models holding a ProcessGroup share the group instead of failing",
    torch=">=1.13",
    upstream="https://github.com/pytorch/pytorch/issues/76927",
    behaviour="copy.deepcopy/copy.copy share ProcessGroup objects",
    errors=(
        Error(r"cannot pickle 'torch\._C\._distributed_c10d\.\w*ProcessGroup\w*' object",
              "TypeError: cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object"),
    ),
)


def _share(self: Any, memo: Optional[Dict[int, Any]] = None) -> Any:
    """``__deepcopy__``/``__copy__``: a copy of a communicator handle is the same handle."""
    return self


@PATCH.on_import("torch.distributed")
def share_groups(patcher: Patcher, dist: ModuleType) -> bool:
    if not dist.is_available():
        return False
    import torch._C._distributed_c10d as c10d

    # ProcessGroup on every torch; from 2.0 the backends (ProcessGroupGloo, ...) derive from the
    # C++ Backend class instead (not torch.distributed.Backend, the string enum).
    classes = [getattr(c10d, name) for name in ("ProcessGroup", "Backend") if hasattr(c10d, name)]
    needed = [cls for cls in classes if "__deepcopy__" not in vars(cls)]
    for cls in needed:
        patcher.setattr(cls, "__deepcopy__", _share)
        patcher.setattr(cls, "__copy__", _share)
    return bool(needed)

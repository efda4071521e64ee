"""Where DTensor's pieces live on each torch, for the DTensor patches (not a patch itself)."""

from typing import Tuple

# OpDispatcher's module: torch 2.2-2.4, then 2.5 and later.
DISPATCH_MODULES = ("torch.distributed._tensor._dispatch", "torch.distributed.tensor._dispatch")


def dtensor_type() -> type:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.1-2.4 (before dtensor-public serves it)
        from torch.distributed._tensor.api import DTensor
    return DTensor


def placement_types() -> Tuple[type, type]:
    """(DTensorSpec, Replicate) wherever this torch keeps them."""
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor.placement_types import Replicate
    except ImportError:  # torch 2.1-2.4
        from torch.distributed._tensor.placement_types import DTensorSpec, Replicate
    return DTensorSpec, Replicate

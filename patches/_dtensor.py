"""Where DTensor's pieces live on each torch, for the DTensor patches (not a patch itself)."""

from typing import Any, Tuple

# OpDispatcher's module: torch 2.2-2.4, then 2.5 and later.
DISPATCH_MODULES = ("torch.distributed._tensor._dispatch", "torch.distributed.tensor._dispatch")
# The pointwise sharding strategies' module: torch 2.2-2.4, then 2.5 and later.
POINTWISE_MODULES = ("torch.distributed._tensor.ops.pointwise_ops", "torch.distributed.tensor._ops._pointwise_ops")


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


def sharding_propagator() -> Any:
    """DTensor's sharding propagator (where the ops' sharding strategies are registered)."""
    try:
        from torch.distributed.tensor._api import DTensor
    except ImportError:  # torch 2.2-2.4
        from torch.distributed._tensor.api import DTensor
    return DTensor._op_dispatcher.sharding_propagator

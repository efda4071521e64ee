"""fsdp2-gradient-divide-factor: ``FSDPModule.set_gradient_divide_factor(factor)`` on torch 2.4.

What breaks:   torchtitan 0.3.0 sets every FSDP module's factor to 1.0 (it divides the loss by the
               global token count itself, so FSDP must sum gradients, not average them): on torch 2.4
               every FSDP run stops at ``AttributeError: 'FSDPLlama3Model' object has no attribute
               'set_gradient_divide_factor'``.
Torch:         2.8 added it: the module's reduce-scatter (and HSDP all-reduce) sums the gradients over
               the data-parallel ranks and divides the sum by ``factor`` (as ``ReduceOp.PREMUL_SUM``
               where the backend has it; gloo does not, fsdp2-gloo-divide-factor: a SUM, then the
               division). 2.4 always averages fp32/bf16 gradients (``ReduceOp.AVG``) and pre/post-divides
               others by its own factors.
Fix:           serve the method: it records the factor on the module's FSDP parameter group; while that
               group reduces its gradients, FSDP's divide factors become "none before, ``factor`` after"
               (2.4's own SUM path: reduce-scatter and all-reduce with SUM, then ``_div_if_needed``, which
               skips a factor of 1). Groups without a factor keep 2.4's averaging.
Upstream:      https://github.com/pytorch/pytorch/pull/150734 (FSDP2 gradient divide factor)
"""

import threading
from types import ModuleType
from typing import Any, Dict, Optional, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-gradient-divide-factor",
    summary="FSDPModule.set_gradient_divide_factor(factor) on torch 2.4: the module's gradients summed over the "
            "data-parallel ranks, then divided by factor",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/150734",
    errors=(  # FSDP's dynamic class (FSDP<module class>) lacks the method
        Error(r"object has no attribute 'set_gradient_divide_factor'",
              "AttributeError: 'FSDPLinear' object has no attribute 'set_gradient_divide_factor'"),
    ),
)
FSDP = "torch.distributed._composable.fsdp"
PATCH.sets(f"{FSDP}.fully_shard.FSDPModule", ("set_gradient_divide_factor",))

_reducing = threading.local()  # .factor: the divide factor of the group reducing now (None: 2.4's own)


def set_gradient_divide_factor(self: Any, factor: float) -> None:
    """Sum this module's gradients over the data-parallel ranks and divide the sum by ``factor``."""
    state = self._get_fsdp_state()
    if (group := state._fsdp_param_group) is not None:
        group._torchpatch_divide_factor = float(factor)


def _post_backward(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    previous = getattr(_reducing, "factor", None)
    _reducing.factor = getattr(instance, "_torchpatch_divide_factor", None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _reducing.factor = previous


def _divide_factors(wrapped: Any, instance: Any, args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> Tuple[Optional[float], Optional[float]]:
    factor = getattr(_reducing, "factor", None)
    if factor is None:
        return wrapped(*args, **kwargs)
    return 1.0, factor  # not None: SUM; 1.0 is not divided by


@PATCH.on_import(f"{FSDP}.fully_shard")
def serve_method(patcher: Patcher, module: ModuleType) -> bool:
    owner = module.FSDPModule
    if hasattr(owner, "set_gradient_divide_factor"):
        return False
    set_gradient_divide_factor.__qualname__ = "FSDPModule.set_gradient_divide_factor"
    patcher.setattr(owner, "set_gradient_divide_factor", set_gradient_divide_factor)
    return True


@PATCH.on_import(f"{FSDP}._fsdp_param_group")
def wrap_post_backward(patcher: Patcher, module: ModuleType) -> bool:
    if not hasattr(module, "foreach_reduce") or "gradient_divide_factor" in vars(module.FSDPParamGroup):
        return False
    patcher.wrap(module.FSDPParamGroup, "post_backward", _post_backward)
    return True


@PATCH.on_import(f"{FSDP}._fsdp_collectives")
def wrap_divide_factors(patcher: Patcher, module: ModuleType) -> bool:
    if not hasattr(module, "_get_gradient_divide_factors"):
        return False
    patcher.wrap(module, "_get_gradient_divide_factors", _divide_factors)
    return True

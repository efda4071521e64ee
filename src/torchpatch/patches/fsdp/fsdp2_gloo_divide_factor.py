"""fsdp2-gloo-divide-factor: FSDP2 with a gradient divide factor on gloo (sum, then divide), torch 2.8
and later.

What breaks:   ``fully_shard`` modules whose gradient divide factor is set
               (``FSDPModule.set_gradient_divide_factor``, which torchtitan 0.2+ always calls) die in
               the first backward on a gloo process group (CPU training, CPU CI) with
               ``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``.
Torch:         2.8 (which added the divide factor) through 2.15: for fp32/bf16 gradients FSDP2
               reduce-scatters with ``ReduceOp.PREMUL_SUM(1 / factor)`` unless the factor equals
               the group size; gloo implements no pre-multiplied sum on any torch.
Fix:           where FSDP2's divide-factor choice would hand a pre-multiplied sum to a gloo
               reduce-scatter group, it takes its own sum-then-divide path instead (the one it
               takes for ``set_force_sum_reduction_for_comms(True)``): reduce with SUM, then divide
               the result by the factor, which is what the pre-multiplied sum computes (up to
               rounding of the float sum's order). Every other choice is torch's own.
Upstream:      https://github.com/pytorch/pytorch/pull/149781 (gloo gained AVG, not PREMUL_SUM);
               FSDP2's ``force_sum_reduction_for_comms`` path is torch's own
"""

import inspect
from typing import Any, Callable, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-gloo-divide-factor",
    summary="FSDP2 with a gradient divide factor on gloo reduces with SUM then divides (no PREMUL_SUM in gloo)",
    torch=">=2.8",
    upstream="https://github.com/pytorch/pytorch/pull/149781",
    behaviour="FSDPModule.set_gradient_divide_factor on gloo",
    errors=(
        Error(r'Cannot use ReduceOp\.PREMUL_SUM with Gloo',
              "RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo"),
    ),
)
MODULE = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


def _on_gloo(group: Any, device_type: str) -> bool:
    import torch

    try:
        return type(group._get_backend(torch.device(device_type or "cpu"))).__name__ == "ProcessGroupGloo"
    except RuntimeError:
        return False


def _divide_factors(premul_sum: Any) -> Callable[..., Any]:
    """The wrapper of ``_get_gradient_divide_factors``: torch's choice stands (one ``isinstance`` and no
    other call on the way) unless it is a pre-multiplied sum (``premul_sum``, ``ReduceOp.PREMUL_SUM``)
    on a gloo reduce-scatter group."""
    from torch._C._distributed_c10d import ReduceOp  # torch.distributed's, set up before FSDP2 imports

    plain = ReduceOp.RedOpType

    def divide_factors(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        factors = wrapped(*args, **kwargs)
        if isinstance(factors[2], plain) or getattr(factors[2], "op", None) != premul_sum:
            return factors
        bound = inspect.signature(wrapped).bind(*args, **kwargs)
        group = bound.arguments.get("reduce_scatter_group")
        if group is None or not _on_gloo(group, bound.arguments.get("device_type", "")):
            return factors
        bound.arguments["force_sum_reduction_for_comms"] = True
        return wrapped(*bound.args, **bound.kwargs)

    return divide_factors


@PATCH.on_import(MODULE)
def sum_then_divide_on_gloo(patcher: Patcher, module: Any) -> bool:
    if "force_sum_reduction_for_comms" not in inspect.signature(module._get_gradient_divide_factors).parameters:
        return False  # an FSDP2 without divide factors (torch < 2.8)
    from torch._C._distributed_c10d import ReduceOp

    patcher.wrap(module, "_get_gradient_divide_factors", _divide_factors(ReduceOp.PREMUL_SUM))
    return True

"""dtensor-stale-scalar-args: a DTensor op that redistributes its inputs runs with this call's
numbers, not the ones of the first call cached for it, torch 2.2-2.8.

What breaks:   ``-5 * dt`` after ``2 * dt`` on a ``Partial`` DTensor gives ``2 * dt`` again;
               ``dt.sum() * i`` in a loop over ``i`` returns the first ``i``'s product every time.
               DTensor caches its sharding decision per op and input placements, and the cache key
               leaves out non-tensor arguments. When the decision says "redistribute the inputs
               first", the dispatcher takes every argument from the cached decision's schema,
               numbers included: the numbers of the first call. No error, the same wrong value on
               every rank (issue #147180).
Torch:         torch 2.4.1 reuses the numbers; torch 2.9.0 and later take only tensor placements
               from the cached schema (``OutputSharding.use_val_from_redistribute_schema``, set for
               the view and factory ops whose shape arguments sharding rewrites). That flag's
               presence decides: where it exists the patch does nothing. Between 2.4 and 2.9 the
               exact release is not determined here (only 2.4.1 and 2.9.0 were run).
Fix:           after torch redistributes an op's local arguments, every non-tensor argument is
               this call's own again, except for the ops whose shape/stride arguments sharding
               propagation adjusts (``op_to_shape_and_stride_idx``: views, ``new_*`` factories),
               which keep the adjusted values, as in torch 2.9.
Upstream:      https://github.com/pytorch/pytorch/issues/147180 (torch 2.9's dispatcher takes the
               values from the redistribute schema only where ``use_val_from_redistribute_schema``)
"""

from types import ModuleType
from typing import Any, Callable, Dict, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import DISPATCH_MODULES

PATCH = Patch(
    id="dtensor-stale-scalar-args",
    summary="DTensor ops that redistribute inputs use this call's numbers, not the cached first call's",
    torch=">=2.2,<2.9",
    upstream="https://github.com/pytorch/pytorch/issues/147180",
    behaviour="dt * 2 then dt * -5 on a Partial DTensor",
    category="correctness",
)


_found: Dict[str, Any] = {}  # "shape_ops": what _shape_ops gave, once


def _shape_ops() -> Any:
    """The ops whose shape arguments sharding propagation rewrites (the propagator exists once an op
    runs; looked up then, once)."""
    try:
        from torch.distributed.tensor._api import DTensor
    except ImportError:  # torch 2.2-2.4
        from torch.distributed._tensor.api import DTensor
    return DTensor._op_dispatcher.sharding_propagator.op_to_shape_and_stride_idx


def _live_scalars(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``OpDispatcher.redistribute_local_args(op_info, ...)`` (only for an op whose inputs move):
    then this call's numbers back into the local arguments."""
    result = wrapped(*args, **kwargs)
    op_info = args[0] if args else kwargs["op_info"]
    shape_ops = _found.get("shape_ops")
    if shape_ops is None:
        shape_ops = _found["shape_ops"] = _shape_ops()
    if op_info.schema.op in shape_ops:  # shapes rewritten for the local shards: keep them
        return result
    live, local_args = op_info.flat_args_schema, op_info.local_args
    if len(live) == len(local_args):
        kept = []
        for spec, local in zip(live, local_args):
            kept.append(local if hasattr(spec, "placements") else spec)
        op_info.local_args = tuple(kept)
    return result


@PATCH.on_import(DISPATCH_MODULES[0])
@PATCH.on_import(DISPATCH_MODULES[1])
def use_live_numbers(patcher: Patcher, dispatch: ModuleType) -> bool:
    dispatcher = getattr(dispatch, "OpDispatcher", None)
    output_sharding = getattr(dispatch, "OutputSharding", None)
    if output_sharding is None:
        try:
            from torch.distributed.tensor._op_schema import OutputSharding as output_sharding
        except ImportError:  # torch 2.2-2.4
            from torch.distributed._tensor._op_schema import OutputSharding as output_sharding
    fields = getattr(output_sharding, "__dataclass_fields__", {})
    if dispatcher is None or "use_val_from_redistribute_schema" in fields:
        return False  # torch 2.9+: the dispatcher already keeps this call's numbers
    if getattr(dispatcher, "_torchpatch_live_scalars", False) or "redistribute_local_args" not in vars(dispatcher):
        return False
    patcher.wrap(dispatcher, "redistribute_local_args", _live_scalars)
    patcher.on_undo(_found.clear)
    patcher.setattr(dispatcher, "_torchpatch_live_scalars", True)
    return True

"""Where DTensor's pieces live on each torch, for the DTensor patches (not a patch itself)."""

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

# OpDispatcher's module: torch 2.2-2.4, then 2.5 and later.
DISPATCH_MODULES = ("torch.distributed._tensor._dispatch", "torch.distributed.tensor._dispatch")
# The pointwise sharding strategies' module: torch 2.2-2.4, then 2.5 and later.
POINTWISE_MODULES = ("torch.distributed._tensor.ops.pointwise_ops", "torch.distributed.tensor._ops._pointwise_ops")
# The redistribution's module (its plans and local conversions): torch 2.2-2.4, then 2.5 and later.
REDISTRIBUTE_MODULES = ("torch.distributed._tensor._redistribute", "torch.distributed.tensor._redistribute")


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


def set_strategy(patcher: Any, op: Any, strategy: Callable[..., Any], schema_info: Any = None) -> None:
    """Register ``strategy`` as ``op``'s sharding strategy in DTensor's propagator (with
    ``schema_info`` where the op had no strategy), undone by ``patcher``."""
    propagator = sharding_propagator()
    funcs, infos = propagator.op_strategy_funcs, propagator.op_to_schema_info
    if op in funcs:
        patcher.on_undo(lambda original=funcs[op]: funcs.__setitem__(op, original))
    else:
        patcher.on_undo(lambda: (funcs.pop(op, None), infos.pop(op, None)))
        if schema_info is not None:
            infos[op] = schema_info
    funcs[op] = strategy


def forget_shardings() -> None:
    """Drop the shardings DTensor cached before a strategy changed (none, normally)."""
    cache = getattr(sharding_propagator().propagate_op_sharding, "cache_clear", None)
    if cache is not None:
        cache()


def partial_reduction(placement: Any) -> Optional[str]:
    """The reduction of a plain ``Partial`` ("sum", "avg", "max", "min"), else None (a _NormPartial
    holds norms, not shares of a value)."""
    if not placement.is_partial() or hasattr(placement, "norm_type"):
        return None
    op = getattr(placement, "reduce_op", None)
    return op if isinstance(op, str) else None


def operand_placements(operands: List[Any]) -> List[List[Any]]:
    """The placements each operand (an ``OpStrategy`` of a DTensor argument) has, as lists."""
    return [list(op.strategies[0].output_spec.placements) for op in operands]


def with_placements(spec: Any, operands: List[Any], output: List[Any], inputs: List[List[Any]],
                    costs: Callable[[Any, Any], List[float]]) -> Any:
    """``spec`` (one sharding of an op) with its output and inputs on these placements, and the
    costs of redistributing each operand to them (``costs``: the pointwise module's
    ``generate_redistribute_costs``)."""
    specs = [dataclasses.replace(s, placements=tuple(p)) for s, p in zip(spec.input_specs, inputs)]
    cost = [costs(op, s) for op, s in zip(operands, specs)] if spec.redistribute_cost else spec.redistribute_cost
    return dataclasses.replace(spec, output_specs=dataclasses.replace(spec.output_spec, placements=tuple(output)),
                               input_specs=specs, redistribute_cost=cost)


def route_sharding_cache(patcher: Any, propagator: Any) -> None:
    """A propagator made before a patch wrapped ``propagate_op_sharding_non_cached`` bound the
    original method into its sharding cache: a new cache of the same kind, through the wrapped
    method (undone by ``patcher``)."""
    cache = propagator.propagate_op_sharding
    method = propagator.propagate_op_sharding_non_cached
    if isinstance(cache, functools._lru_cache_wrapper):  # torch 2.4-2.8
        routed = functools.lru_cache(None)(method)
    elif isinstance(getattr(cache, "cache", None), functools._lru_cache_wrapper):  # 2.9+: LocalLRUCache
        routed = type(cache)(method)
    else:
        raise RuntimeError("DTensor's sharding cache is of a kind torchpatch does not know")
    patcher.setattr(propagator, "propagate_op_sharding", routed)


def wrap_transform_plan(patcher: Any, redistribute: Any, wrapper: Callable[..., Any]) -> bool:
    """Wrap the plan of a redistribution, ``_gen_transform_infos(src_spec, dst_spec)``, which torch
    makes once per pair of specs, with ``wrapper`` (a wrapt wrapper; undone by ``patcher``): on torch
    2.5+ its maker called on a cache miss (plans cached so far forgotten), on 2.4 a new lru_cache over
    the wrapped function. False where this torch caches no plan."""
    cached = getattr(redistribute, "_gen_transform_infos", None)
    if hasattr(redistribute, "_gen_transform_infos_non_cached"):  # 2.5+
        patcher.wrap(redistribute, "_gen_transform_infos_non_cached", wrapper)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
        return True
    if hasattr(cached, "cache_clear") and hasattr(cached, "__wrapped__"):  # 2.4: an lru_cache of the plan
        import wrapt

        patcher.setattr(redistribute, "_gen_transform_infos",
                        functools.lru_cache(maxsize=None)(wrapt.FunctionWrapper(cached.__wrapped__, wrapper)))
        return True
    return False


_passing: Dict[type, type] = {}  # an exception type: its subclass that passes DTensor's dispatcher


def passing_dispatch(exc_type: type, op: Any) -> type:
    """``exc_type``, or a subclass of it that DTensor's dispatcher lets through as it is: it turns any
    error of sharding propagation into ``RuntimeError("Sharding propagation failed for ...")`` (2.9:
    without the words), but re-raises a ``NotImplementedError`` of an op torch does not decompose.
    The subclass is named as ``exc_type`` (``IndexError``, ``RuntimeError``): ``except IndexError``
    catches it and tracebacks print the type torch prints."""
    import torch

    if issubclass(exc_type, NotImplementedError) or torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
        return exc_type
    if exc_type not in _passing:
        bases = (NotImplementedError,) if issubclass(NotImplementedError, exc_type) else (exc_type, NotImplementedError)
        _passing[exc_type] = type(exc_type.__name__, bases, {"__module__": exc_type.__module__,
                                                             "__doc__": exc_type.__doc__})
    return _passing[exc_type]


# dtensor-strided-shard-pointwise's mark on the pointwise module once applied
STRIDED_POINTWISE_DONE = "_torchpatch_strided_shard_pointwise"


def strided_shard_type() -> Optional[type]:
    """This torch's ``_StridedShard`` (torch 2.5+), else None."""
    from torch.distributed.tensor import placement_types

    return getattr(placement_types, "_StridedShard", None)


def maps_strided_shard(utils: Any, strided: type) -> bool:
    """Whether this torch's ``map_placements_after_broadcast`` (``utils``: DTensor's ``_ops.utils``) keeps a
    ``_StridedShard`` (the upstream fix) rather than making it ``Shard``."""
    import torch

    mapped = utils.map_placements_after_broadcast((strided(0, split_factor=2),), torch.Size([4]), [0])
    return isinstance(mapped[0], strided)


def pointwise_keeps_strided_shard() -> bool:
    """Whether DTensor's pointwise ops keep a ``_StridedShard`` operand's placement here
    (dtensor-strided-shard-pointwise applied, or a torch that does it itself)."""
    import importlib

    pointwise = importlib.import_module("torch.distributed.tensor._ops._pointwise_ops")
    strided = strided_shard_type()
    if strided is None or getattr(pointwise, STRIDED_POINTWISE_DONE, False):
        return True
    if not hasattr(pointwise, "common_pointwise_strategy"):
        return True  # 2.12's single-dim rules
    return maps_strided_shard(importlib.import_module("torch.distributed.tensor._ops.utils"), strided)


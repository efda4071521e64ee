"""dtensor-reduction-strategy: DTensor reductions that silently return wrong values, torch 2.2-2.13.

What breaks:   DTensor's reduction sharding strategy reduces each rank's local piece and leaves a
               pending ``Partial`` reduction, also where that is not the right answer. No error,
               no warning; the global value is wrong:
               - a reduction of a ``Partial("sum")`` DTensor (a loss summed over shards, a gradient
                 in tensor parallelism) that is not a sum: ``norm()`` / ``linalg.vector_norm``
                 adds the ranks' norms (2 ranks holding [1, 3] and [2, 1] give
                 sqrt(10) + sqrt(5) = 5.40, the norm of the sum [3, 4] is 5), ``amax`` / ``max``
                 / ``min`` take the maximum of the summands; ``sum()`` of a ``_NormPartial``
                 (a norm computed on shards) sums the ranks' partial norms;
               - ``mean()`` over a dimension sharded unevenly (3 rows on 2 ranks) averages the
                 ranks' means, ignoring that rank 0 holds 2 rows and rank 1 holds 1;
               - ``all()`` over a sharded dimension sums the ranks' booleans: it is ``any()``;
               - ``max(dim)`` / ``min(dim)`` over the sharded dimension returns each rank's local
                 index, reduced with ``max``: the indices are wrong (the values are right).
Torch:         the reduction strategy (``common_reduction_strategy``) came with torch 2.2-2.3;
               torch 2.4.1 and 2.9.0 have all of these bugs (``mean`` on gloo on 2.4 only once
               ``gloo-avg`` lets ``Partial("avg")`` run); torch 2.13.0 still sums a
               ``_NormPartial`` (and only that); torch 2.14.1 and 2.15.0 have none of them. Fixed
               upstream in pieces between 2.10 and 2.14, so each piece is checked on its own: the
               ``Partial`` check by the upstream condition (``reduce_op != reduction_op``) in
               ``common_reduction_strategy``'s source, the ``_NormPartial`` one by that source
               naming ``_NormPartial`` or ``sum`` no longer using ``linear_reduction_strategy``
               (2.14's single-dim strategies), the uneven mean by the
               ``is_tensor_evenly_shardable_on_dim`` helper the fix imports, ``all`` by the
               reduce op torch maps it to (``"product"`` once fixed), ``max.dim`` / ``min.dim``
               by whether they still use the linear reduction strategy.
Fix:           (1) where a strategy's input holds a ``Partial`` whose reduce op is not the
               reduction's own (any ``Partial`` for a norm; a ``_NormPartial`` for anything but
               its own max/min), or (2) the reduction is a mean and a reduced dimension is
               sharded unevenly, that strategy is replaced by torch's own non-linear one (the
               ``Partial`` is reduced and the reduced dimensions gathered before the local op);
               every other strategy is torch's own. (3) ``all`` maps to the ``"product"``
               reduction (the logical and of the ranks' booleans), as upstream. (4) ``max.dim``
               and ``min.dim`` gather the reduced dimension first (values and indices are then
               computed on the whole dimension) and stay sharded on the other dimensions.
Upstream:      https://github.com/pytorch/pytorch/pull/159856 (norm of Partial),
               https://github.com/pytorch/pytorch/pull/165962 (reductions of Partial),
               https://github.com/pytorch/pytorch/pull/172288 (sum of _NormPartial),
               https://github.com/pytorch/pytorch/pull/163241 (mean with uneven sharding),
               https://github.com/pytorch/pytorch/issues/165923 (all() reduced with sum),
               https://github.com/pytorch/pytorch/pull/175776 (max.dim/min.dim indices,
               issue https://github.com/pytorch/pytorch/issues/168940)
"""

import inspect
from types import ModuleType
from typing import Any, Callable, Dict, List, Sequence, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import forget_shardings, set_strategy, sharding_propagator
from torchpatch.patches._source import torch_source

PATCH = Patch(
    id="dtensor-reduction-strategy",
    summary="DTensor norm/amax of Partial, mean over uneven shards, all() and max(dim) indices "
    "over sharded dims give the global result",
    torch=">=2.2,<2.14",
    upstream="https://github.com/pytorch/pytorch/pull/165962",
    behaviour="DTensor reductions over Partial / unevenly sharded / sharded dims",
    category="correctness",
)

MATH_MODULES = ("torch.distributed._tensor.ops.math_ops", "torch.distributed.tensor._ops._math_ops")
_DONE = "_torchpatch_reduction_strategy"  # set on a math-ops module this patch has fixed


def _is_shard(p: Any) -> bool:
    return p.is_shard() if hasattr(p, "is_shard") else False


def _op_name(reduce_op: Any) -> str:
    """A reduce op as torch >= 2.4 spells it: "sum", "max"... (2.2-2.3 keep a ``ReduceOp``)."""
    name = getattr(reduce_op, "name", reduce_op)
    return {"PRODUCT": "product", "AVG": "avg"}.get(str(name), str(name).lower())


def _partial_mismatch(placements: Sequence[Any], reduction_op: Any, fix_partial: bool, fix_norm: bool) -> bool:
    """Whether a pending ``Partial`` cannot be carried through this reduction."""
    for p in placements:
        if not p.is_partial():
            continue
        pending = _op_name(p.reduce_op)
        if hasattr(p, "norm_type"):  # _NormPartial: only its max/min (inf norms) commute
            if fix_norm and not (pending in ("max", "min") and pending == reduction_op):
                return True
        elif fix_partial and (not isinstance(reduction_op, str) or pending != reduction_op):
            return True
    return False


def _uneven(spec: Any, reduce_dims: Sequence[int]) -> bool:
    """Whether a reduced dimension of ``spec``'s global shape is split unevenly over the mesh."""
    meta = spec.tensor_meta
    if meta is None:
        return False
    shape = list(meta.shape)
    for dim in reduce_dims:
        shards, strided = 1, 1
        for mesh_dim, p in enumerate(spec.placements):
            if _is_shard(p) and p.dim % max(len(shape), 1) == dim % max(len(shape), 1):
                shards *= spec.mesh.size(mesh_dim)
                strided = max(strided, getattr(p, "split_factor", 1) * shards)
        if shape and (shape[dim] % shards or shape[dim] % strided):
            return True
    return False


def _wrap_common_reduction(patcher: Patcher, math_ops: ModuleType, fix_partial: bool, fix_norm: bool, fix_avg: bool) -> None:
    signature = inspect.signature(math_ops.common_reduction_strategy)

    def common_reduction_strategy(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if not a["reduction_linear"]:
            return wrapped(*args, **kwargs)
        op, dims = a["reduction_op"], list(a["reduce_dims"])
        replace: List[bool] = []
        for op_spec in a["input_strategy"].strategies:
            spec = op_spec.output_spec
            replace.append(_partial_mismatch(spec.placements, op, fix_partial, fix_norm)
                           or (fix_avg and op == "avg" and _uneven(spec, dims)))
        if not any(replace):
            return wrapped(*args, **kwargs)
        linear = wrapped(*args, **kwargs)
        a["reduction_linear"] = False
        gathered = wrapped(*bound.args, **bound.kwargs)
        # both lists follow the input strategies one for one: keep torch's linear choice where right
        linear.strategies = [g if r else s for s, g, r in zip(linear.strategies, gathered.strategies, replace)]
        return linear

    patcher.wrap(math_ops, "common_reduction_strategy", common_reduction_strategy)


def _max_min_dim(math_ops: ModuleType, takes_mesh: bool) -> Callable[..., Any]:
    """A strategy for ``max.dim`` / ``min.dim``: the reduced dimension gathered, others kept."""

    def strategy(*args: Any) -> Any:
        op_schema = args[-1]
        input_strategy = op_schema.args_schema[0]
        ndim = input_strategy.ndim
        dim = op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0
        dims = [dim % ndim] if ndim else []
        keep_dim = len(op_schema.args_schema) > 2 and bool(op_schema.args_schema[2])
        op = math_ops.LINEAR_REDUCTION_OP_MAP.get(op_schema.op, "max")
        head = (args[0],) if takes_mesh else ()
        return math_ops.common_reduction_strategy(
            *head, input_strategy, dims, keep_dim=keep_dim, reduction_linear=False, reduction_op=op)

    return strategy


@PATCH.on_import(MATH_MODULES[0])
@PATCH.on_import(MATH_MODULES[1])
def fix_reductions(patcher: Patcher, math_ops: ModuleType) -> bool:
    if getattr(math_ops, _DONE, False) or not hasattr(math_ops, "common_reduction_strategy"):
        return False
    import torch

    aten = torch.ops.aten
    op_map = getattr(math_ops, "LINEAR_REDUCTION_OP_MAP", {})
    source = torch_source(math_ops.common_reduction_strategy)
    fix_partial = "reduce_op != reduction_op" not in source
    fix_avg = not hasattr(math_ops, "is_tensor_evenly_shardable_on_dim")
    fix_all = op_map.get(aten.all.default) == "sum"
    funcs = sharding_propagator().op_strategy_funcs
    linear = getattr(math_ops, "linear_reduction_strategy", None)
    # sum of a _NormPartial: wrong while sum goes through common_reduction_strategy (2.14 moved the
    # linear reductions to single-dim strategies that never carry a _NormPartial through)
    fix_norm = linear is not None and funcs.get(aten.sum.default) is linear and "_NormPartial" not in source
    fix_max_dim = [op for op in (aten.max.dim, aten.min.dim) if linear is not None and funcs.get(op) is linear]
    if not (fix_partial or fix_norm or fix_avg or fix_all or fix_max_dim):
        return False
    if fix_partial or fix_norm or fix_avg:
        _wrap_common_reduction(patcher, math_ops, fix_partial, fix_norm, fix_avg)
    if fix_all:
        for op in (aten.all.default, aten.all.dim):
            if op_map.get(op) == "sum":
                op_map[op] = "product"
                patcher.on_undo(lambda op=op: op_map.__setitem__(op, "sum"))
    if fix_max_dim:
        takes_mesh = "mesh" in inspect.signature(math_ops.common_reduction_strategy).parameters
        strategy = _max_min_dim(math_ops, takes_mesh)
        for op in fix_max_dim:
            set_strategy(patcher, op, strategy)
    patcher.setattr(math_ops, _DONE, True)
    forget_shardings()
    return True

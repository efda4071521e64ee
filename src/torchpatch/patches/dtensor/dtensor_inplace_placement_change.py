"""dtensor-inplace-placement-change: an in-place op that would have to redistribute the DTensor it
writes to computes what torch 2.13 computes instead of silently dropping the write, torch 2.2-2.12:
the linear ones keep the ``Partial``, the others raise torch 2.13's error.

What breaks:   ``dt.clamp_(max=2)``, ``dt.exp_()``, ``dt.abs_()``, ``dt.neg_()``, ``dt.div_(2.0)``,
               ``torch._foreach_mul_(grads, clip_coef)`` on DTensors with a pending ``Partial`` (a
               loss summed over shards, a gradient in tensor parallelism), or any in-place op whose
               sharding strategy wants its ``self`` argument in another placement: DTensor
               redistributes ``self`` into a new local tensor, runs the in-place op on that copy,
               and returns ``self`` with its old local tensor. The DTensor keeps its old value
               (``exp_`` does nothing; ``clip_grad_norm_`` of tensor-parallel gradients silently
               skips the clip), with no error (issue #163374: ``clamp_(max=2)`` of a partial 144
               stays 144).
Torch:         torch 2.4.1 and 2.9.0 drop the write (2.9 keeps ``mul_`` right, 2.4 drops it too; 2.4
               has no strategy for ``_foreach_div_.Scalar``/``.Tensor`` and fails on them; 2.9's
               ``copy_`` of a partial into a partial is dropped too). torch 2.13.0, 2.14.1 and
               2.15.0 keep the ``Partial`` of ``self`` where their pointwise rules allow it: a
               ``Partial("sum"/"avg")`` multiplied, divided (by a number or a replicated tensor) or
               negated (linear: (a1 + a2) * c = a1 * c + a2 * c); a sum or average plus or minus
               one of its kind, an average, max or min plus or minus a replicated tensor (not a
               number); a ``Partial("max"/"min")`` through a non-decreasing function (``exp_``,
               ``relu_``, ``sigmoid_``, ``floor_``, ``tanh_``, ...: f(max(a1, a2)) = max(f(a1),
               f(a2))); ``copy_`` of a partial of the same kind. For the others (``exp_`` of a sum,
               ``neg_`` of a max, a number added to any ``Partial``) they raise ``RuntimeError:
               aten.exp_.default: in-place operations that require placement changes are not
               supported. The input has placement (Partial(sum),), but no valid strategy preserves
               this placement. ...``. A torch whose DTensor op utilities already carry that
               message is left alone; a torch whose pointwise strategies are torch 2.12's
               single-dim rules (which keep these Partials) keeps its own.
Fix:           (1) those in-place ops (and their foreach forms) get torch 2.13's rules in their
               sharding strategy: where torch would reduce ``self``'s ``Partial`` (or keeps it but
               asks an operand for a Partial the rule does not allow), the ``Partial`` is kept and
               the other operands take a placement the rule allows (replicated, or the same
               ``Partial`` for a replicated or sharded operand added to or copied into a sum: a
               shard's redistribution is planned through ``Replicate``, gathered then split, since
               this torch plans no ``Shard`` -> ``Partial``, and torch 2.14+ compute it), so ``self`` is not
               redistributed and the op runs on the DTensor's own local tensor. (2) before DTensor
               redistributes the arguments of any other in-place op (a schema name ending in
               ``_``), the placements asked for its first argument (each tensor of the list, for
               the foreach ops) are compared with the ones it has; if they differ, torch 2.13's
               ``RuntimeError`` is raised in its words (and what this torch would have done). The
               check runs where DTensor decides the op's sharding, on a sharding-cache miss (the cache
               keeps no error), as torch 2.13 raises there: not on every call of an op whose inputs move. In-place
               ops that keep ``self``'s placements (``add_`` of partials, ``zero_``, ...) run as before.
Upstream:      https://github.com/pytorch/pytorch/issues/163374 (the report); torch 2.13 raises from
               its single-dim strategy expansion (https://github.com/pytorch/pytorch/pull/172477)
               and keeps these Partials by its pointwise rules (``_MUL_RULES``, ``_DIV_RULES``,
               ``_NEG_RULES``, ``scalar_linear_ops``, ``_BINARY_ADDITIVE_RULES``,
               ``_NON_DECREASING_RULES``, ``_ALL_PARTIAL_BINARY_PRESERVING_RULES``)
"""

import dataclasses
import math
import os
import sys
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import (DISPATCH_MODULES, POINTWISE_MODULES, REDISTRIBUTE_MODULES, forget_shardings,
                                         operand_placements, partial_reduction, passing_dispatch, placement_types,
                                         route_sharding_cache, set_strategy, sharding_propagator, with_placements,
                                         wrap_transform_plan)

PATCH = Patch(
    id="dtensor-inplace-placement-change",
    summary="in-place DTensor ops that would redistribute their own input compute as on torch 2.13 "
    "(keep a Partial where its rules do, else raise) instead of leaving it unchanged",
    torch=">=2.2,<2.13",
    upstream="https://github.com/pytorch/pytorch/issues/163374",
    behaviour="partial_dtensor.exp_()/.neg_()/.add_(x), _foreach_mul_(partials, c) and other in-place ops needing a placement change",
    category="correctness",
)

_UPSTREAM_MESSAGE = "in-place operations that require placement changes"


def _specs(arg: Any) -> List[Any]:
    """The DTensor specs of an in-place op's first argument (a list for the foreach ops)."""
    items = arg if isinstance(arg, (list, tuple)) else [arg]
    return [s for s in items if hasattr(s, "placements")]


def _check_self_redistribution(schema: Any, suggested: Any) -> None:
    """Raise torch 2.13's error where an in-place op's ``self`` would be redistributed to ``suggested``."""
    if schema.op._schema.name.endswith("_") and schema.args_schema and suggested.args_schema:
        for have, want in zip(_specs(schema.args_schema[0]), _specs(suggested.args_schema[0])):
            if tuple(have.placements) != tuple(want.placements):
                raise passing_dispatch(RuntimeError, schema.op)(  # not rewrapped by DTensor's dispatcher
                    f"{schema.op}: {_UPSTREAM_MESSAGE} are not supported. The input has placement "
                    f"{tuple(have.placements)}, but no valid strategy preserves this placement. Please use "
                    "the out-of-place version of this operation instead. (torchpatch "
                    "dtensor-inplace-placement-change: torch 2.13 and later raise this error; this torch would "
                    f"run the op on a copy redistributed to {tuple(want.placements)} and leave the DTensor "
                    "unchanged.)")


def _refuse_in_propagation(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ShardingPropagator.propagate_op_sharding_non_cached(op_schema)``, only on a sharding-cache miss
    (the cache keeps no error: an op refused is refused on every call), as torch 2.13 refuses in its
    strategy expansion; an op whose inputs move makes no call here once its sharding is cached."""
    sharding = wrapped(*args, **kwargs)
    suggested = getattr(sharding, "redistribute_schema", None)
    if getattr(sharding, "needs_redistribute", False) and suggested is not None:
        _check_self_redistribution(args[0] if args else kwargs["op_schema"], suggested)
    return sharding


def _refuse_self_redistribution(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``OpDispatcher.redistribute_local_args(op_info, suggested_input_schema)``, where the
    propagator has no uncached method to wrap."""
    op_info = args[0] if args else kwargs["op_info"]
    _check_self_redistribution(op_info.schema, args[1] if len(args) > 1 else kwargs["suggested_input_schema"])
    return wrapped(*args, **kwargs)


def _fixed_upstream(dispatch: ModuleType) -> bool:
    """Whether DTensor's op utilities (next to ``_dispatch``) already raise torch 2.13's error: read
    as text, since importing them here, while DTensor itself is being imported, would be circular."""
    here = os.path.dirname(getattr(dispatch, "__file__", None) or "")
    for parts in (("_ops", "utils.py"), ("ops", "utils.py")):  # torch 2.5+, torch 2.2-2.4
        path = os.path.join(here, *parts)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                return _UPSTREAM_MESSAGE in f.read()
    return False


@PATCH.on_import(DISPATCH_MODULES[0])
@PATCH.on_import(DISPATCH_MODULES[1])
def refuse_inplace_redistribution(patcher: Patcher, dispatch: ModuleType) -> bool:
    dispatcher = getattr(dispatch, "OpDispatcher", None)
    if dispatcher is None or "redistribute_local_args" not in vars(dispatcher):
        return False
    if getattr(dispatcher, "_torchpatch_inplace_checked", False) or _fixed_upstream(dispatch):
        return False
    propagator = getattr(dispatch, "ShardingPropagator", None)
    if propagator is not None and hasattr(propagator, "propagate_op_sharding_non_cached"):
        patcher.wrap(propagator, "propagate_op_sharding_non_cached", _refuse_in_propagation)
        api = sys.modules.get("torch.distributed.tensor._api") or sys.modules.get("torch.distributed._tensor.api")
        existing = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
        if existing is not None:  # DTensor imported before torchpatch was installed
            route_sharding_cache(patcher, existing.sharding_propagator)
    else:
        patcher.wrap(dispatcher, "redistribute_local_args", _refuse_self_redistribution)
    patcher.setattr(dispatcher, "_torchpatch_inplace_checked", True)
    return True


# torch 2.13's sharding rules for in-place ops that keep a Partial of ``self`` (its _MUL_RULES,
# _DIV_RULES, _NEG_RULES, scalar_linear_ops, _BINARY_ADDITIVE_RULES, _NON_DECREASING_RULES): for each
# reduction of ``self``'s Partial kept, the placements the other tensor operands may take on that mesh
# dim ("P": the same Partial, "R": replicated, "r": replicated if it is; none: no other operand).
_LINEAR = {"sum": "R", "avg": "R"}  # (a1 + a2) * c = a1 * c + a2 * c
_ADDITIVE = {"sum": "P", "avg": "PR", "max": "R", "min": "R"}  # max(a1, a2) + c = max(a1 + c, a2 + c)
_NON_DECREASING = {"max": "", "min": ""}  # f(max(a1, a2)) = max(f(a1), f(a2))
_ALL = ("default",)
_KEPT: Dict[str, Tuple[Tuple[str, ...], Dict[str, str]]] = {
    "mul_": (("Tensor", "Scalar"), _LINEAR),
    "div_": (("Tensor", "Scalar"), _LINEAR),
    "neg_": (_ALL, _LINEAR),
    "_foreach_mul_": (("Scalar", "ScalarList", "Tensor", "List"), _LINEAR),
    "_foreach_div_": (("Scalar", "ScalarList", "Tensor", "List"), _LINEAR),
    "_foreach_neg_": (_ALL, _LINEAR),
    "add_": (("Tensor",), _ADDITIVE),  # of a tensor: adding a number keeps no Partial
    "sub_": (("Tensor",), _ADDITIVE),
    "_foreach_add_": (("List",), _ADDITIVE),
    "_foreach_sub_": (("List",), _ADDITIVE),
    "_foreach_exp_": (_ALL, _NON_DECREASING),
    "_foreach_clamp_max_": (("Scalar",), _NON_DECREASING),
    "_foreach_clamp_min_": (("Scalar",), _NON_DECREASING),
    "round_": (("default", "decimals"), _NON_DECREASING),
    **{f"{name}_": (_ALL, _NON_DECREASING) for name in (
        "asinh", "atan", "ceil", "deg2rad", "erf", "exp", "exp2", "expm1", "floor", "nan_to_num", "rad2deg",
        "relu", "sgn", "sigmoid", "sign", "sinh", "tanh", "trunc")},
}
_OPERAND_NEEDED = {"add_", "sub_", "_foreach_add_", "_foreach_sub_"}


def _reduction(placement: Any) -> Optional[str]:
    """How a Partial of ``self`` reduces: a plain Partial's op, and a pending inf (-inf) norm's "max"
    ("min"): the ranks' norms reduce by their max, which torch 2.12+ make a plain ``Partial("max")``,
    so ``relu_`` of ``vector_norm(x, inf)`` keeps it, as torch 2.15 computes it."""
    norm_type = getattr(placement, "norm_type", None)
    if placement.is_partial() and norm_type in (math.inf, -math.inf):
        return "max" if norm_type > 0 else "min"
    return partial_reduction(placement)


def _children(strategy: Any) -> Any:
    """A foreach op's per-tensor strategies (``childs`` before torch 2.5), or None for one tensor."""
    children = getattr(strategy, "children", None)
    return children if children is not None else getattr(strategy, "childs", None)  # no 2.9 FutureWarning


def _others_placements(kept: Any, allowed: str, current: List[Any], replicate: Any) -> Optional[List[Any]]:
    """Where ``self`` keeps the Partial ``kept``, the placements of the other operands on that mesh
    dim, from what each has (``current``) and what the rule allows: "P" ``kept`` (which a replicated
    or sharded operand becomes only for a sum, its value split), "R" replicated (any operand, reduced), "r"
    replicated if it is already. None if an operand can take none of them (a Partial of another
    kind where the rule wants ``kept``: torch 2.13 never converts one Partial into another)."""
    placements = []
    for have in current:
        if ("P" in allowed and have == kept) or (("R" in allowed or "r" in allowed) and have.is_replicate()):
            placements.append(have)
        elif "R" in allowed:
            placements.append(replicate)
        elif "P" in allowed and (have.is_replicate() or have.is_shard()) and partial_reduction(kept) == "sum":
            placements.append(kept)  # a shard through Replicate (split_shards_through_replicate), as torch 2.15
        else:
            return None
    return placements


def _keep_partial(operands: List[Any], result: Any, rule: Dict[str, str], operand_needed: bool,
                  costs: Callable[[Any, Any], List[float]]) -> Any:
    """``result`` (torch's strategy for one tensor ``self``, ``operands[0]``'s strategy) with each
    Partial of ``self`` that ``rule`` keeps kept on the mesh dims where torch would reduce it (and
    replicate the output) or keeps it: there the other operands take a placement the rule allows."""
    have = operand_placements(operands)
    dims = [i for i, p in enumerate(have[0]) if _reduction(p) in rule]
    if not dims or (operand_needed and len(operands) < 2):
        return result
    replicate = placement_types()[1]()
    specs = []
    for spec in result.strategies:
        out, inputs = spec.output_spec, list(spec.input_specs or ())
        if len(inputs) != len(operands):
            specs.append(spec)
            continue
        placements = [list(s.placements) for s in inputs]
        out_placements = list(out.placements)
        for i in dims:
            kept = have[0][i]
            reduced = out_placements[i].is_replicate() and all(p[i].is_replicate() for p in placements)
            if not (reduced or out_placements[i] == placements[0][i] == kept):
                continue
            others = _others_placements(kept, rule[_reduction(kept)], [h[i] for h in have[1:]], replicate)
            if others is None:
                continue
            out_placements[i] = placements[0][i] = kept
            for p, placement in zip(placements[1:], others):
                p[i] = placement
        if out_placements == list(out.placements) and all(p == list(s.placements) for p, s in zip(placements, inputs)):
            specs.append(spec)
            continue
        specs.append(with_placements(spec, operands, out_placements, placements, costs))
    result.strategies = specs
    return result


def _tensor_operands(args_schema: Any) -> List[Any]:
    """The strategies of an op's tensor arguments, in order (a foreach op's are lists)."""
    return [a for a in args_schema if hasattr(a, "strategies") or _children(a) is not None]


def _keeping_strategy(original: Callable[..., Any], rule: Dict[str, str], operand_needed: bool,
                      costs: Callable[[Any, Any], List[float]]) -> Callable[..., Any]:
    """``original`` (a pointwise strategy: ``(mesh, op_schema)`` before torch 2.5, ``(op_schema)``
    after) with torch 2.13's rule for an in-place op that keeps a Partial of ``self``."""

    def strategy(*args: Any) -> Any:
        operands = _tensor_operands(args[-1].args_schema)
        result = original(*args)
        children = _children(operands[0])
        if children is None:
            return _keep_partial(operands, result, rule, operand_needed, costs)
        lists = [_children(op) or [op] * len(children) for op in operands]  # a tensor is broadcast
        for k, out in enumerate(_children(result) or ()):
            _keep_partial([ops[k] for ops in lists], out, rule, operand_needed, costs)
        return result

    strategy.__name__ = f"{getattr(original, '__name__', 'strategy')}_keeping_partials"
    return strategy


@PATCH.on_import(POINTWISE_MODULES[0])
@PATCH.on_import(POINTWISE_MODULES[1])
def keep_partials_as_torch_2_13_does(patcher: Patcher, pointwise: ModuleType) -> bool:
    """Register torch 2.13's rules for the in-place ops that keep a Partial of ``self``."""
    if not all(hasattr(pointwise, name) for name in ("pointwise_strategy", "list_pointwise_strategy",
                                                     "generate_redistribute_costs", "RuntimeSchemaInfo")):
        return False  # torch 2.12's single-dim pointwise rules keep these Partials themselves
    import torch

    funcs = sharding_propagator().op_strategy_funcs
    costs = pointwise.generate_redistribute_costs
    changed = False
    for name, (overloads, rule) in _KEPT.items():
        packet = getattr(torch.ops.aten, name, None)
        for overload in overloads:
            op = getattr(packet, overload, None)
            original, info = funcs.get(op), None
            if op is not None and original is None and name.startswith("_foreach_div_"):
                # torch 2.4 has no _foreach_div_.Scalar/.Tensor strategy at all
                original, info = pointwise.list_pointwise_strategy, pointwise.RuntimeSchemaInfo(needs_pytree=True)
            if original is None:
                continue
            set_strategy(patcher, op, _keeping_strategy(original, rule, name in _OPERAND_NEEDED, costs), info)
            changed = True
    if changed:
        forget_shardings()
    return changed


# torch 2.13 keeps any Partial through copy_ of a source with that Partial (a replicated source is
# already a Partial avg, max or min of itself; a sum's is split); a Partial of another kind it refuses
_COPY = {"sum": "P", "avg": "Pr", "max": "Pr", "min": "Pr"}


@PATCH.on_import("torch.distributed.tensor._ops._tensor_ops")
def keep_partials_through_copy(patcher: Patcher, tensor_ops: ModuleType) -> bool:
    """torch 2.5+ gives ``copy_`` the (non-linear) pointwise strategy: register torch 2.13's rule."""
    import torch

    from torch.distributed.tensor._ops import _pointwise_ops as pointwise

    op = torch.ops.aten.copy_.default
    original = sharding_propagator().op_strategy_funcs.get(op)
    if getattr(original, "__name__", None) != "pointwise_strategy" or not hasattr(pointwise, "generate_redistribute_costs"):
        return False  # torch 2.4 (its own copy strategy keeps Partials), or 2.13's single-dim rules
    set_strategy(patcher, op, _keeping_strategy(original, _COPY, True, pointwise.generate_redistribute_costs))
    forget_shardings()
    return True



def _shard_to_partial_sum(redistribute: ModuleType) -> Callable[..., Any]:
    """A wrapper of ``_gen_transform_infos(src_spec, dst_spec)``, the plan of a redistribution: a
    ``Shard`` asked to become a ``Partial("sum")`` (an operand of a sum's ``add_``, ``sub_`` or
    ``copy_``), which this torch's redistribution refuses ("redistribute from S(0) to P not supported
    yet"), is gathered (replicated) by the plan of the rest, then split (Replicate -> Partial), as
    torch 2.15 moves it; the plan is made once per pair of specs (cached by torch)."""

    def plan(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        src, dst = (args + tuple(kwargs.values()))[:2]
        dims = [i for i, (have, want) in enumerate(zip(src.placements, dst.placements))
                if have.is_shard() and want.is_partial() and partial_reduction(want) == "sum"]
        if not dims:
            return wrapped(*args, **kwargs)
        replicate = placement_types()[1]()
        gathered = dataclasses.replace(dst, placements=tuple(
            replicate if i in dims else p for i, p in enumerate(dst.placements)))
        steps = list(wrapped(src, gathered))
        info = redistribute._TransformInfo
        split = [info(mesh_dim=i, src_dst_placements=(replicate, dst.placements[i]), logical_shape=list(src.shape))
                 for i in dims]  # a local division: after the gathering, on any mesh dim
        return steps + split

    return plan


@PATCH.on_import(REDISTRIBUTE_MODULES[0])
@PATCH.on_import(REDISTRIBUTE_MODULES[1])
def split_shards_through_replicate(patcher: Patcher, redistribute: ModuleType) -> bool:
    """Plan a ``Shard`` -> ``Partial("sum")`` redistribution through ``Replicate``."""
    if not hasattr(redistribute, "redistribute_local_tensor") or not hasattr(redistribute, "_TransformInfo"):
        return False
    shard = getattr(sys.modules.get(placement_types()[1].__module__), "Shard", None)
    if hasattr(shard, "_to_partial_tensor"):  # torch 2.14+ zero-fill a shard into a Partial("sum") themselves
        return False
    return wrap_transform_plan(patcher, redistribute, _shard_to_partial_sum(redistribute))

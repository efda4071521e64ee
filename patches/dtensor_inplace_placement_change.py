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
               has no strategy for ``_foreach_div_.Scalar``/``.Tensor`` and fails on them); torch
               2.13.0, 2.14.1 and 2.15.0 multiply, divide and negate a ``Partial("sum")`` or
               ``Partial("avg")`` in place by a number or a replicated tensor, keeping the
               ``Partial`` (these ops are linear: (a1 + a2) * c = a1 * c + a2 * c), and raise
               ``RuntimeError: aten.exp_.default: in-place operations that require placement
               changes are not supported`` for the others. A torch whose DTensor op utilities
               already carry that message is left alone; a torch whose pointwise strategies are
               torch 2.12's single-dim rules (which keep the ``Partial`` of linear ops) keeps its own.
Fix:           (1) the in-place ``mul_``, ``div_`` (by a number, a 0-dim or a replicated tensor),
               ``neg_`` and their foreach forms get torch 2.13's rule in the sharding strategy:
               a ``Partial("sum")``/``Partial("avg")`` of ``self`` is kept (the other operands
               replicated), so nothing is redistributed and the op runs on the DTensor's own local
               tensor. (2) before DTensor redistributes the arguments of any other in-place op (a
               schema name ending in ``_``), the placements asked for its first argument (each
               tensor of the list, for the foreach ops) are compared with the ones it has; if they
               differ, the same ``RuntimeError`` as torch 2.13's is raised, naming both
               placements. In-place ops that keep ``self``'s placements (``add_`` of partials,
               ``zero_``, ...) run as before.
Upstream:      https://github.com/pytorch/pytorch/issues/163374 (the report); torch 2.13 raises from
               its single-dim strategy expansion (https://github.com/pytorch/pytorch/pull/172477)
               and keeps the ``Partial`` of linear ops by its pointwise rules (``_MUL_RULES``,
               ``_DIV_RULES``, ``_NEG_RULES``, ``scalar_linear_ops``)
"""

import dataclasses
import os
from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._dtensor import DISPATCH_MODULES, POINTWISE_MODULES, sharding_propagator

PATCH = Patch(
    id="dtensor-inplace-placement-change",
    summary="in-place DTensor ops that would redistribute their own input compute as on torch 2.13 "
    "(mul_/div_/neg_ keep a Partial, the others raise) instead of leaving it unchanged, torch 2.2-2.12",
    torch=">=2.2,<2.13",
    upstream="https://github.com/pytorch/pytorch/issues/163374",
    behaviour="partial_dtensor.exp_()/.neg_(), _foreach_mul_(partials, c) and other in-place ops needing a placement change",
    category="correctness",
)

_UPSTREAM_MESSAGE = "in-place operations that require placement changes"


def _specs(arg: Any) -> List[Any]:
    """The DTensor specs of an in-place op's first argument (a list for the foreach ops)."""
    items = arg if isinstance(arg, (list, tuple)) else [arg]
    return [s for s in items if hasattr(s, "placements")]


def _refuse_self_redistribution(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    op_info = args[0] if args else kwargs["op_info"]
    suggested = args[1] if len(args) > 1 else kwargs["suggested_input_schema"]
    schema = op_info.schema
    if schema.op._schema.name.endswith("_") and schema.args_schema and suggested.args_schema:
        for have, want in zip(_specs(schema.args_schema[0]), _specs(suggested.args_schema[0])):
            if tuple(have.placements) != tuple(want.placements):
                raise RuntimeError(
                    f"{schema.op}: {_UPSTREAM_MESSAGE} are not supported. The input has placement "
                    f"{tuple(have.placements)}, but the op needs {tuple(want.placements)}: it would run on a "
                    "redistributed copy and leave the DTensor unchanged (torchpatch "
                    "dtensor-inplace-placement-change; torch >= 2.13 raises too). Please use the "
                    "out-of-place version of this operation instead.")
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
    patcher.wrap(dispatcher, "redistribute_local_args", _refuse_self_redistribution)
    patcher.setattr(dispatcher, "_torchpatch_inplace_checked", True)
    return True


# In-place ops linear in ``self`` (the other operands replicated): torch 2.13 keeps a Partial("sum") or
# Partial("avg") of ``self`` through them (its _MUL_RULES, _DIV_RULES, _NEG_RULES, scalar_linear_ops).
_LINEAR_INPLACE = {"mul_": ("Tensor", "Scalar"), "div_": ("Tensor", "Scalar"), "neg_": ("default",),
                   "_foreach_mul_": ("Scalar", "ScalarList", "Tensor", "List"),
                   "_foreach_div_": ("Scalar", "ScalarList", "Tensor", "List"),
                   "_foreach_neg_": ("default",)}
_LINEAR_REDUCE_OPS = ("sum", "avg")


def _children(strategy: Any) -> Any:
    """A foreach op's per-tensor strategies (``childs`` before torch 2.5), or None for one tensor."""
    return getattr(strategy, "children", getattr(strategy, "childs", None))


def _linear_partial(placement: Any) -> bool:
    return (placement.is_partial() and getattr(placement, "reduce_op", None) in _LINEAR_REDUCE_OPS
            and not hasattr(placement, "norm_type"))  # a _NormPartial holds norms, not summands


def _keep_partial(self_strategy: Any, result: Any, costs: Callable[[Any, Any], List[float]]) -> Any:
    """``result`` (torch's strategy for one tensor ``self``) with each ``Partial("sum"/"avg")`` of
    ``self`` kept on the mesh dims where torch would reduce it and replicate the output."""
    have = self_strategy.strategies[0].output_spec.placements
    dims = [i for i, p in enumerate(have) if _linear_partial(p)]
    if not dims:
        return result
    specs = []
    for spec in result.strategies:
        out, inputs = spec.output_spec, list(spec.input_specs or ())
        keep = [i for i in dims if inputs and out.placements[i].is_replicate()
                and all(s.placements[i].is_replicate() for s in inputs)]
        if not keep:
            specs.append(spec)
            continue
        out_placements, self_placements = list(out.placements), list(inputs[0].placements)
        for i in keep:
            out_placements[i] = self_placements[i] = have[i]
        inputs[0] = dataclasses.replace(inputs[0], placements=tuple(self_placements))
        cost = list(spec.redistribute_cost or ())
        if cost:
            cost[0] = costs(self_strategy, inputs[0])
        specs.append(dataclasses.replace(spec, output_specs=dataclasses.replace(out, placements=tuple(out_placements)),
                                         input_specs=inputs, redistribute_cost=cost or spec.redistribute_cost))
    result.strategies = specs
    return result


def _linear_strategy(original: Callable[..., Any], costs: Callable[[Any, Any], List[float]]) -> Callable[..., Any]:
    """``original`` (a pointwise strategy: ``(mesh, op_schema)`` before torch 2.5, ``(op_schema)``
    after) with torch 2.13's rule for in-place ops linear in ``self``."""

    def strategy(*args: Any) -> Any:
        self_strategy = args[-1].args_schema[0]
        result = original(*args)
        children = _children(self_strategy)
        if children is None:
            return _keep_partial(self_strategy, result, costs)
        for child, out in zip(children, _children(result) or ()):
            _keep_partial(child, out, costs)
        return result

    strategy.__name__ = f"{getattr(original, '__name__', 'strategy')}_keeping_linear_partials"
    return strategy


@PATCH.on_import(POINTWISE_MODULES[0])
@PATCH.on_import(POINTWISE_MODULES[1])
def keep_partials_of_linear_inplace_ops(patcher: Patcher, pointwise: ModuleType) -> bool:
    """Register torch 2.13's rule for ``mul_``/``div_``/``neg_`` (and foreach) of a Partial."""
    if not all(hasattr(pointwise, name) for name in ("pointwise_strategy", "list_pointwise_strategy",
                                                     "generate_redistribute_costs", "RuntimeSchemaInfo")):
        return False  # torch 2.12's single-dim pointwise rules keep these Partials themselves
    import torch

    propagator = sharding_propagator()
    funcs, infos = propagator.op_strategy_funcs, propagator.op_to_schema_info
    costs = pointwise.generate_redistribute_costs
    changed = False
    for name, overloads in _LINEAR_INPLACE.items():
        packet = getattr(torch.ops.aten, name)
        for overload in overloads:
            op = getattr(packet, overload, None)
            if op is None:
                continue
            original = funcs.get(op)
            if original is None:  # torch 2.4 has no _foreach_div_.Scalar/.Tensor strategy at all
                if not name.startswith("_foreach_"):
                    continue
                original = pointwise.list_pointwise_strategy
                infos[op] = pointwise.RuntimeSchemaInfo(needs_pytree=True)
                patcher.on_undo(lambda op=op: (funcs.pop(op, None), infos.pop(op, None)))
            else:
                patcher.on_undo(lambda op=op, original=original: funcs.__setitem__(op, original))
            funcs[op] = _linear_strategy(original, costs)
            changed = True
    cache = getattr(propagator.propagate_op_sharding, "cache_clear", None)
    if changed and cache is not None:  # shardings computed before the fix (none, normally) are not reused
        cache()
    return changed

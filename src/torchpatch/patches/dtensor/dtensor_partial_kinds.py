"""dtensor-partial-kinds: DTensor turns a Partial of one kind into another without reducing it
(``Partial("sum") + Partial("max")`` adds the max as if it were a sum), silently, torch 2.2-2.12.

What breaks:   adding DTensors whose pending reductions differ in kind on a mesh dim (a sum and a
               max, a sum and an average): the linear pointwise strategy of ``add`` keeps the first
               operand's ``Partial`` and asks the other to become a ``Partial`` of that kind, and
               redistributing one ``Partial`` into another kind does nothing to the local tensors.
               Each rank adds its share of the max to its share of the sum and the sum of those is
               reported: ``P(sum) + P(max)`` of full values [3, 1] and [4, 4] gives [9, 3] for [7,
               5]; on 2.4 ``P(max) + P(sum)`` gives the max of the ranks' sums. In place,
               ``sum.add_(max)`` likewise.
Torch:         torch 2.4.1 and 2.9.0 (reproduced on gloo); torch 2.13.0, 2.14.1 and 2.15.0 reduce the
               operands whose ``Partial`` cannot be kept (their rules for add and sub keep a sum or
               average with one of its kind, and an average, max or min with a replicated value),
               and raise ``AssertionError: Redistribution from one partial type (P(max)) to another
               (P(sum)) is unsupported.`` where a conversion is still asked (``sum.add_(max)`` in
               place). A torch whose redistribution already raises that error, or whose pointwise
               strategies are the single-dim rules, is left alone.
Fix:           (1) ``add``/``sub`` out of place: on a mesh dim where the first operand is a
               ``Partial`` and another operand holds a ``Partial`` that cannot go with it (another
               kind, or a max or min with a max or min, which torch 2.13 reduces too), the other
               operands are reduced (replicated) and the first's average, max or min is kept
               (adding a replicated value commutes with them); a first sum is reduced too. (2) redistributing a ``Partial`` into a
               ``Partial`` of another kind raises torch 2.13's ``AssertionError``, in its words.
Upstream:      https://github.com/pytorch/pytorch/pull/172041 (the error) and
               https://github.com/pytorch/pytorch/pull/172042 (no strategy that needs the conversion)
"""

from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import (POINTWISE_MODULES, REDISTRIBUTE_MODULES, forget_shardings, operand_placements,
                                         partial_reduction, placement_types, set_strategy, sharding_propagator,
                                         with_placements, wrap_transform_plan)
from torchpatch.patches._source import torch_source

PATCH = Patch(
    id="dtensor-partial-kinds",
    summary="DTensor Partials of different kinds added together are reduced first, and a Partial is never "
    "redistributed into another kind (torch 2.13's error)",
    torch=">=2.2,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/172041",
    behaviour="partial_sum + partial_max, partial_sum.add_(partial_max)",
    category="correctness",
)

_UPSTREAM_MESSAGE = "Redistribution from one partial type"


def _check_conversion(current: Any, target: Any) -> None:
    for have, want in zip(current.placements, target.placements):
        a, b = partial_reduction(have), partial_reduction(want)  # a _NormPartial's conversions stay torch's
        if a is not None and b is not None and a != b:
            raise AssertionError(f"Redistribution from one partial type (P({a})) to another (P({b})) is unsupported. "
                                 "(torchpatch dtensor-partial-kinds: torch 2.13 and later raise this error; this torch "
                                 "would leave the local tensors as they are, a wrong value.)")


def _refuse_in_plan(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``_gen_transform_infos(src_spec, dst_spec)``, the plan of a redistribution, made once per
    pair of specs (cached: a refusal is never cached, so it raises every time)."""
    _check_conversion(*(args + tuple(kwargs.values()))[:2])
    return wrapped(*args, **kwargs)


def _refuse_in_redistribution(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                              kwargs: Dict[str, Any]) -> Any:
    """``redistribute_local_tensor(local, current_spec, target_spec)``, where torch has no cached plan."""
    _check_conversion(args[1] if len(args) > 1 else kwargs["current_spec"],
                      args[2] if len(args) > 2 else kwargs["target_spec"])
    return wrapped(*args, **kwargs)


@PATCH.on_import(REDISTRIBUTE_MODULES[0])
@PATCH.on_import(REDISTRIBUTE_MODULES[1])
def refuse_partial_conversions(patcher: Patcher, redistribute: ModuleType) -> bool:
    if not hasattr(redistribute, "redistribute_local_tensor"):
        return False
    if _UPSTREAM_MESSAGE in torch_source(redistribute):
        return False
    if not wrap_transform_plan(patcher, redistribute, _refuse_in_plan):  # no plan cached: checked on every
        patcher.wrap(redistribute, "redistribute_local_tensor", _refuse_in_redistribution)  # redistribution
    return True


def _mixed(first: Any, others: List[Any]) -> bool:
    """Whether a first operand with the Partial ``first`` cannot be added to ``others`` as they are
    (a Partial of another kind, or a max or min with a max or min)."""
    kept = partial_reduction(first)
    kinds = [partial_reduction(p) for p in others if p.is_partial()]
    return kept is not None and any(k != kept or kept in ("max", "min") for k in kinds)


def _reduce_mixed(operands: List[Any], result: Any, costs: Callable[[Any, Any], List[float]]) -> Any:
    """``result`` (torch's strategy for an out-of-place add or sub) with the operands reduced on each
    mesh dim where their Partials cannot go together: the first's average, max or min kept."""
    have = operand_placements(operands)
    dims = [i for i, p in enumerate(have[0]) if _mixed(p, [h[i] for h in have[1:]])]
    if not dims:
        return result
    replicate = placement_types()[1]()
    specs = []
    for spec in result.strategies:
        if len(spec.input_specs or ()) != len(operands):
            specs.append(spec)
            continue
        placements = [list(s.placements) for s in spec.input_specs]
        out = list(spec.output_spec.placements)
        for i in dims:
            kept = have[0][i] if partial_reduction(have[0][i]) in ("avg", "max", "min") else replicate
            out[i] = placements[0][i] = kept
            for p in placements[1:]:
                p[i] = replicate
        specs.append(with_placements(spec, operands, out, placements, costs))
    result.strategies = specs
    return result


def _reducing_mixed(original: Callable[..., Any], costs: Callable[[Any, Any], List[float]]) -> Callable[..., Any]:
    def strategy(*args: Any) -> Any:
        operands = [a for a in args[-1].args_schema if hasattr(a, "strategies")]
        return _reduce_mixed(operands, original(*args), costs)

    strategy.__name__ = f"{getattr(original, '__name__', 'strategy')}_reducing_mixed_partials"
    return strategy


@PATCH.on_import(POINTWISE_MODULES[0])
@PATCH.on_import(POINTWISE_MODULES[1])
def reduce_mixed_partials(patcher: Patcher, pointwise: ModuleType) -> bool:
    if not all(hasattr(pointwise, name) for name in ("pointwise_strategy", "generate_redistribute_costs")):
        return False  # torch 2.13's single-dim pointwise rules
    import torch

    funcs = sharding_propagator().op_strategy_funcs
    changed = False
    for op in (torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor):
        original = funcs.get(op)
        if original is not None:
            set_strategy(patcher, op, _reducing_mixed(original, pointwise.generate_redistribute_costs))
            changed = True
    if changed:
        forget_shardings()
    return changed

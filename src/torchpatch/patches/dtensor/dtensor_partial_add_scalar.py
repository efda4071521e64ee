"""dtensor-partial-add-scalar: ``partial_dtensor + 10`` adds 10 once, not once per rank, torch 2.1-2.12.

What breaks:   adding a Python number to a DTensor with a pending ``Partial("sum")`` (a loss
               summed over shards, ``dt.sum()`` of a sharded tensor, a norm computed on shards)
               adds the number on every rank and keeps the result partial: the global value is
               off by (ranks - 1) times the number. On 2 ranks ``dt.sum() + 10`` is the sum plus
               20. ``clip_grad_norm_`` on DTensor gradients computes ``max_norm / (total_norm +
               1e-6)`` on a partial norm, so the clip coefficient is (slightly) wrong too. Adding a
               tensor instead of a number is right (the tensor is replicated, then split).
               On 2.4 the foreach form (``torch._foreach_add(partials, 10)``) has the same bug.
Torch:         add is a "linear" op in DTensor's pointwise rule (2.1) and strategy (2.2 on), and its
               Partial propagates whatever the other operand is; torch 2.1.2, 2.4.1 and 2.9.0 give the wrong
               sum, torch 2.13.0, 2.14.1 and 2.15.0 the right one (the fix, merged in December
               2025, is in 2.10 or 2.11). A torch whose pointwise strategies already test for a
               number operand (``_Number``) or whose strategies no longer have the old
               ``pointwise_strategy`` (2.13's single-dim rewrite) is left alone.
Fix:           ``add.Tensor`` with a number operand takes the non-linear pointwise strategy: the
               Partial operand is reduced first (one all-reduce), then the number is added once.
               On torch 2.2-2.4 the foreach ``_foreach_add.Scalar`` / ``.ScalarList`` likewise.
               The in-place forms (``add_``, ``_foreach_add_``) then need their DTensor reduced
               first, which dtensor-inplace-placement-change (required) refuses with torch 2.13's
               ``RuntimeError``, as torch 2.13 does: reducing it would leave the DTensor's own
               local tensor untouched (the add would go to a reduced copy). Adding DTensors or
               tensors stays linear.
Upstream:      https://github.com/pytorch/pytorch/pull/170030 (issues
               https://github.com/pytorch/pytorch/issues/163193 and
               https://github.com/pytorch/pytorch/issues/149768)
"""

import inspect
from types import ModuleType
from typing import Any, Callable, Dict, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import POINTWISE_MODULES
from torchpatch.patches._source import torch_source

PATCH = Patch(
    id="dtensor-partial-add-scalar",
    summary="DTensor Partial + Python number adds the number once (reduces the Partial first)",
    torch=">=2.1,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/170030",
    behaviour="partial_dtensor + number",
    category="correctness",
    # the first refuses the in-place adds of a number to a Partial; without the second, torch 2.2-2.8
    # reuse the first number added (partial + 20 after partial + 10 gives the sum + 10)
    requires=("dtensor-inplace-placement-change", "dtensor-stale-scalar-args"),
)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, complex))  # bool is an int


def _not_linear(linearity: Any) -> Any:
    """The "no linearity" value of this torch's ``linearity`` argument (bool before 2.5, int after)."""
    return False if isinstance(linearity, bool) else -1


def _op_of(op_schema: Any, ops: Tuple[Any, ...]) -> Any:
    """The op of ``ops`` this schema is for, or None (torch 2.1's OpSchema names it by its
    ``func_schema`` only)."""
    op = getattr(op_schema, "op", None)
    if op is not None:
        return op if op in ops else None
    func = op_schema.func_schema
    for candidate in ops:
        if (candidate._schema.name, candidate._schema.overload_name) == (func.name, func.overload_name):
            return candidate
    return None


def _wrapper(signature: inspect.Signature, ops: Tuple[Any, ...], needs_number: bool) -> Callable[..., Any]:
    def strategy(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        linearity = a.get("linearity", False)
        op_schema = a["op_schema"]
        op = _op_of(op_schema, ops)
        if op is None or linearity in (False, -1):
            return wrapped(*args, **kwargs)
        if needs_number and not any(_is_number(x) for x in op_schema.args_schema[1:]):
            return wrapped(*args, **kwargs)
        a["linearity"] = _not_linear(linearity)
        return wrapped(*bound.args, **bound.kwargs)

    return strategy


@PATCH.on_import(POINTWISE_MODULES[0])
@PATCH.on_import(POINTWISE_MODULES[1])
def reduce_before_adding_numbers(patcher: Patcher, pointwise: ModuleType) -> bool:
    if getattr(pointwise, "_torchpatch_partial_add_scalar", False):
        return False
    if not (hasattr(pointwise, "pointwise_strategy") and hasattr(pointwise, "linear_pointwise_ops")):
        return False  # torch 2.13's single-dim pointwise strategies: fixed there
    if "_Number" in torch_source(pointwise):
        return False  # the upstream fix tests args for numbers
    import torch

    aten = torch.ops.aten
    signature = inspect.signature(pointwise.pointwise_strategy)
    patcher.wrap(pointwise, "pointwise_strategy",
                 _wrapper(signature, (aten.add.Tensor, aten.add_.Tensor), needs_number=True))
    list_strategy = getattr(pointwise, "list_pointwise_strategy", None)
    if list_strategy is not None and "mesh" in inspect.signature(list_strategy).parameters:
        # torch 2.2-2.4: the foreach add of numbers propagates the Partial too (2.5+ never does)
        foreach = tuple(getattr(aten._foreach_add, name) for name in ("Scalar", "ScalarList"))
        foreach += tuple(getattr(aten._foreach_add_, name) for name in ("Scalar", "ScalarList"))
        patcher.wrap(pointwise, "list_pointwise_strategy",
                     _wrapper(inspect.signature(list_strategy), foreach, needs_number=False))
    patcher.setattr(pointwise, "_torchpatch_partial_add_scalar", True)
    return True


@PATCH.on_import("torch.distributed._tensor.ops.common_rules")
def reduce_before_adding_numbers_by_rule(patcher: Patcher, rules: ModuleType) -> bool:
    """torch 2.1: pointwise sharding is a rule (``linear_pointwise_rule`` calls ``pointwise_rule``
    with ``linearity=True``), not yet a strategy; the same fix applies to it."""
    if not (hasattr(rules, "linear_pointwise_rule") and hasattr(rules, "pointwise_rule")):
        return False
    if getattr(rules, "_torchpatch_partial_add_scalar", False):
        return False
    import torch

    signature = inspect.signature(rules.pointwise_rule)
    if "linearity" not in signature.parameters:
        return False
    patcher.wrap(rules, "pointwise_rule", _wrapper(signature, (torch.ops.aten.add.Tensor,), needs_number=True))
    patcher.setattr(rules, "_torchpatch_partial_add_scalar", True)
    return True

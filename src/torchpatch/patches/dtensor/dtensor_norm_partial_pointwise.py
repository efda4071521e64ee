"""dtensor-norm-partial-pointwise: ``dt.norm() * -2`` of a sharded DTensor loses its sign, torch 2.2-2.10.

What breaks:   a norm of a sharded DTensor (``dt.norm()``, ``torch.linalg.vector_norm``) is a pending
               ``_NormPartial``: each rank holds the norm of its shard, and the reduction raises
               them to the power p, sums and takes the p-th root. DTensor's linear pointwise
               strategies keep that placement as if it were a ``Partial("sum")`` (its reduce op is
               "sum"), so the op runs on each rank's partial norm before that reduction: on 2
               ranks ``dt.norm() * -2`` gives +10.198 for -10.198 (the square drops the sign; a
               p=3 norm gives nan), ``dt.norm() + other_norm`` or ``dt.norm() + dt.sum()`` gives
               the norm of the sums instead of the sum of the norms, and ``norm.mul_(c)`` /
               ``norm.add_(x)`` in place likewise. No error, no warning.
Torch:         the linear strategies carry any ``Partial`` whose reduce op is "sum": torch 2.4.1
               (``add`` and ``div.Scalar``) and 2.9.0 (``mul`` by a number or a tensor, ``add``,
               in place too) are wrong, torch 2.10 too (its pointwise module has no
               ``_NormPartial`` check); torch 2.11 reduces the ``_NormPartial`` first (upstream
               keeps it only for a multiplication or division by a non-negative number), torch
               2.12-2.15's single-dim rules never keep a ``_NormPartial``: 2.15.0 gives the
               right value, a replicated result, and raises ``RuntimeError: aten.mul_.Tensor:
               in-place operations that require placement changes are not supported. ...`` for
               the in-place ops on a ``_NormPartial`` (``mul_``, ``div_``, ``add_``, ``neg_``).
               A torch whose pointwise module names ``_NormPartial`` (the upstream fix) or has no
               ``common_pointwise_strategy`` (2.12's single-dim rules) is left alone.
Fix:           where the linear pointwise strategy (``common_pointwise_strategy`` with a
               linearity, the foreach lists' too) would keep a ``_NormPartial`` in its output, it
               is computed as non-linear instead: the ``_NormPartial`` (and any other ``Partial``
               operand) is reduced first, as on torch 2.15. The in-place forms then need their
               DTensor reduced first, which dtensor-inplace-placement-change (required) refuses
               with torch 2.13's ``RuntimeError``, as torch 2.15 does.
Upstream:      https://github.com/pytorch/pytorch/pull/170035 (issue thread
               https://github.com/pytorch/pytorch/pull/167813)
"""

import inspect
from types import ModuleType
from typing import Any, Callable, Dict, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import POINTWISE_MODULES, forget_shardings
from torchpatch.patches._source import torch_source

PATCH = Patch(
    id="dtensor-norm-partial-pointwise",
    summary="DTensor pointwise ops reduce a pending norm (_NormPartial) first instead of computing on each "
    "rank's partial norm (norm * -2 kept its sign)",
    torch=">=2.2,<2.11",
    upstream="https://github.com/pytorch/pytorch/pull/170035",
    behaviour="dtensor.norm() * -2, norm + norm, norm.mul_(c)",
    category="correctness",
    requires=("dtensor-inplace-placement-change",),
)

_DONE = "_torchpatch_norm_partial_pointwise"


def _is_norm_partial(placement: Any) -> bool:
    return placement.is_partial() and hasattr(placement, "norm_type")


def _keeps_norm_partial(result: Any) -> bool:
    """Whether a pointwise ``OpStrategy`` gives an output placed as a ``_NormPartial``."""
    for spec in getattr(result, "strategies", ()):
        out = spec.output_spec
        if any(_is_norm_partial(p) for p in getattr(out, "placements", ())):
            return True
    return False


def _not_linear(linearity: Any) -> Any:
    """The "no linearity" value of this torch's ``linearity`` argument (bool before 2.5, int after)."""
    return False if isinstance(linearity, bool) else -1


def _reducing_norm_partials(signature: inspect.Signature) -> Callable[..., Any]:
    def common_pointwise_strategy(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                                  kwargs: Dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        linearity = bound.arguments.get("linearity", False)
        if linearity in (False, -1) or not _keeps_norm_partial(result):
            return result
        bound.arguments["linearity"] = _not_linear(linearity)
        return wrapped(*bound.args, **bound.kwargs)

    return common_pointwise_strategy


@PATCH.on_import(POINTWISE_MODULES[0])
@PATCH.on_import(POINTWISE_MODULES[1])
def reduce_norm_partials_first(patcher: Patcher, pointwise: ModuleType) -> bool:
    strategy = getattr(pointwise, "common_pointwise_strategy", None)
    if strategy is None or getattr(pointwise, _DONE, False):
        return False  # torch 2.12's single-dim rules never keep a _NormPartial
    try:
        signature = inspect.signature(strategy)
    except (TypeError, ValueError):
        return False
    if "linearity" not in signature.parameters or "_NormPartial" in torch_source(pointwise):
        return False  # the upstream fix (torch 2.11) checks for _NormPartial itself
    patcher.wrap(pointwise, "common_pointwise_strategy", _reducing_norm_partials(signature))
    patcher.setattr(pointwise, _DONE, True)
    forget_shardings()
    return True

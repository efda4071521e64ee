"""dtensor-inplace-placement-change: an in-place op that would have to redistribute the DTensor it
writes to raises, as on torch 2.13, instead of silently dropping the write, torch 2.2-2.12.

What breaks:   ``dt.clamp_(max=2)``, ``dt.exp_()``, ``dt.abs_()`` on a DTensor with a pending
               ``Partial`` (a loss summed over shards, a gradient in tensor parallelism),
               ``torch._foreach_add_(partials, 1)``, or any in-place op whose sharding strategy
               wants its ``self`` argument in another placement: DTensor redistributes ``self``
               into a new local tensor, runs the in-place op on that copy, and returns ``self``
               with its old local tensor. The DTensor keeps its old value (``exp_`` does nothing),
               with no error (issue #163374: ``clamp_(max=2)`` of a partial 144 stays 144).
Torch:         torch 2.4.1 and 2.9.0 drop the write; torch 2.13.0, 2.14.1 and 2.15.0 raise
               ``RuntimeError: aten.exp_.default: in-place operations that require placement
               changes are not supported`` from the strategy expansion. A torch whose DTensor op
               utilities already carry that message is left alone.
Fix:           before DTensor redistributes the arguments of an in-place op (a schema name ending
               in ``_``), the placements asked for its first argument (each tensor of the list, for
               the foreach ops) are compared with the ones it has; if they differ, the same
               ``RuntimeError`` as torch 2.13's is raised, naming both placements. In-place ops
               that keep ``self``'s placements (``add_`` of partials, ``mul_`` by a replicated
               tensor, ``zero_``, ...) run as before.
Upstream:      https://github.com/pytorch/pytorch/issues/163374 (the report); torch 2.13 raises from
               its single-dim strategy expansion (https://github.com/pytorch/pytorch/pull/172477)
"""

import os
from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._dtensor import DISPATCH_MODULES

PATCH = Patch(
    id="dtensor-inplace-placement-change",
    summary="in-place DTensor ops that would redistribute their own input raise (as on torch 2.13) "
    "instead of leaving it unchanged, torch 2.2-2.12",
    torch=">=2.2,<2.13",
    upstream="https://github.com/pytorch/pytorch/issues/163374",
    behaviour="partial_dtensor.exp_() and other in-place ops needing a placement change",
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

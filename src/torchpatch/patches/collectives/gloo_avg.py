"""gloo-avg: functional ``all_reduce(x, "avg", group)`` on gloo, torch 2.2-2.6.

What breaks:   code that averages a metric with a functional collective (torchtitan's
               ``dist_mean`` of the loss, every data-parallel run) dies on a gloo group with
               ``RuntimeError: Cannot use ReduceOp.AVG with Gloo``: CPU training, CPU CI.
Torch:         gloo gained AVG in torch 2.7 (a SUM followed by a division by the group size);
               2.2-2.6's functional collectives pass "avg" to it unchanged. (On 1.13 and 2.1,
               ``functional-collectives`` already reduces "avg" on gloo as a sum and a division.)
Fix:           ``torch.distributed._functional_collectives.all_reduce`` with "avg" on a group
               whose backend for the tensor's device is gloo reduces with "sum" and divides by the
               group's size, as torch 2.7's gloo does; every other call is torch's own. Integer
               tensors give a float average here, where torch >= 2.7 raises on the cast back.
Upstream:      https://github.com/pytorch/pytorch/pull/149781 (ProcessGroupGloo AVG, torch 2.7)
"""

import inspect
from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="gloo-avg",
    summary='functional all_reduce(x, "avg") on gloo groups as a sum and a division',
    torch=">=2.2,<2.7",
    upstream="https://github.com/pytorch/pytorch/pull/149781",
    behaviour='funcol.all_reduce(x, "avg", gloo_group)',
    errors=(
        Error(r'Cannot use ReduceOp\.AVG with Gloo',
              "RuntimeError: Cannot use ReduceOp.AVG with Gloo"),
    ),
)


def _is_gloo(group: Any, tensor: Any) -> bool:
    """Whether the group reduces ``tensor`` with gloo: asked of the group's backend for the tensor's
    device (a group made by ``init_process_group()`` without a backend names itself "undefined")."""
    try:
        backend = group._get_backend(tensor.device)
    except RuntimeError:  # no backend for that device: torch's own call will say so
        return False
    return type(backend).__name__ == "ProcessGroupGloo"


def _all_reduce(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    a = bound.arguments
    if str(a["reduceOp"]).lower() != "avg":
        return wrapped(*args, **kwargs)
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(funcol._resolve_group_name(a["group"], a.get("tag", "")))
    if not _is_gloo(group, a["self"]):
        return wrapped(*args, **kwargs)
    return wrapped(a["self"], "sum", a["group"], a.get("tag", "")) / group.size()


@PATCH.on_import("torch.distributed._functional_collectives")
def average_on_gloo(patcher: Patcher, funcol: Any) -> bool:
    if not hasattr(funcol, "_resolve_group_name"):
        return False  # torch 2.1's module (functional-collectives handles it there)
    patcher.wrap(funcol, "all_reduce", _all_reduce)
    return True

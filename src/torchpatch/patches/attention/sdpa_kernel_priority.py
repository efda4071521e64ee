"""sdpa-kernel-priority: ``sdpa_kernel(backends, set_priority=True)`` on torch 2.3-2.5.

What breaks:   torchtitan (2025) runs attention in ``with sdpa_kernel([FLASH_ATTENTION,
               EFFICIENT_ATTENTION, MATH], set_priority=True):``; on torch 2.4 every forward dies
               with ``TypeError: sdpa_kernel() got an unexpected keyword argument 'set_priority'``.
Torch:         2.3-2.5 have ``sdpa_kernel(backends)`` (enable exactly these backends) but no way to
               reorder them: among the enabled backends torch tries its fixed order, flash, then
               memory-efficient, then math (cuDNN's place in that order changed between releases).
               2.6 added ``set_priority``.
Fix:           accept ``set_priority``. With ``set_priority=False``, or a list whose order is this
               torch's own order (flash before memory-efficient before math, cuDNN not among several),
               the call enables the same backends in the same priority as torch >= 2.6 would: exact.
               Any other order cannot be had on this torch and raises ``NotImplementedError``
               naming the order, rather than silently running another backend first.
Upstream:      https://github.com/pytorch/pytorch/pull/140467 (torch 2.6)
"""

import inspect
from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="sdpa-kernel-priority",
    summary="torch.nn.attention.sdpa_kernel(..., set_priority=True) on torch 2.3-2.5 (orders this torch can honour)",
    torch=">=2.3,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/140467",
    behaviour="sdpa_kernel(backends, set_priority=...)",
    errors=(
        Error(r"sdpa_kernel\(\) got an unexpected keyword argument 'set_priority'",
              "TypeError: sdpa_kernel() got an unexpected keyword argument 'set_priority'"),
    ),
)

FIXED_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _check_order(backends: Any) -> None:
    names = [b.name for b in (backends if isinstance(backends, list) else [backends])]
    if len(names) <= 1:
        return
    known = [n for n in names if n in FIXED_ORDER]
    if len(known) == len(names) and known == sorted(known, key=FIXED_ORDER.index):
        return
    import torch

    raise NotImplementedError(
        f"sdpa_kernel({names}, set_priority=True): torch {torch.__version__} tries the enabled backends in its "
        f"fixed order ({', '.join(FIXED_ORDER)}) and cannot prefer another; priority orders need torch >= 2.6 "
        f"(torchpatch serves set_priority only for orders this torch follows)"
    )


def _sdpa_kernel(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    kwargs = dict(kwargs)
    if kwargs.pop("set_priority", False):
        _check_order(args[0] if args else kwargs["backends"])
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.nn.attention")
def add_set_priority(patcher: Patcher, attention: Any) -> bool:
    if "set_priority" in inspect.signature(attention.sdpa_kernel).parameters:
        return False
    patcher.wrap(attention, "sdpa_kernel", _sdpa_kernel)
    return True

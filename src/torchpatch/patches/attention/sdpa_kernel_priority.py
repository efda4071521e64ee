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
               Another order enables the backends, and attention on a CPU tensor runs as on torch
               2.15, which ignores the priority there too (a CPU query tries flash, then math, under any
               order: measured on 2.15.0, ``[MATH, FLASH_ATTENTION]`` gives flash's bits); attention on
               any other device inside that block raises ``NotImplementedError`` naming the order,
               rather than silently running another backend first. (torchtitan 0.2.2 attends under
               ``[CUDNN_ATTENTION, FLASH_ATTENTION, MATH]``.)
Upstream:      https://github.com/pytorch/pytorch/pull/140467 (torch 2.6)
"""

import contextlib
import inspect
import threading
from typing import Any, Dict, Iterator, List, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="sdpa-kernel-priority",
    summary="torch.nn.attention.sdpa_kernel(..., set_priority=True) on torch 2.3-2.5 (orders this torch can honour; "
    "any order on CPU tensors, where torch ignores it)",
    torch=">=2.3,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/140467",
    behaviour="sdpa_kernel(backends, set_priority=...)",
    errors=(
        Error(r"sdpa_kernel\(\) got an unexpected keyword argument 'set_priority'",
              "TypeError: sdpa_kernel() got an unexpected keyword argument 'set_priority'"),
    ),
)

FIXED_ORDER = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
_UNFOLLOWED = threading.local()  # .orders: the open blocks' orders this torch follows on CPU tensors only


def _names(backends: Any) -> List[str]:
    return [b.name for b in (backends if isinstance(backends, list) else [backends])]


def _followed(names: List[str]) -> bool:
    known = [n for n in names if n in FIXED_ORDER]
    return len(names) <= 1 or (len(known) == len(names) and known == sorted(known, key=FIXED_ORDER.index))


def _refuse(names: List[str], where: str) -> None:
    import torch

    raise NotImplementedError(
        f"sdpa_kernel({names}, set_priority=True){where}: torch {torch.__version__} tries the enabled backends in "
        f"its fixed order ({', '.join(FIXED_ORDER)}) and cannot prefer another; priority orders need torch >= 2.6 "
        f"(torchpatch serves set_priority only for orders this torch follows, and any order on CPU tensors)"
    )


@contextlib.contextmanager
def _cpu_only(context: Any, names: List[str]) -> Iterator[Any]:
    orders = _UNFOLLOWED.__dict__.setdefault("orders", [])
    with context as entered:
        orders.append(names)
        try:
            yield entered
        finally:
            orders.pop()


def _sdpa_kernel(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    kwargs = dict(kwargs)
    if kwargs.pop("set_priority", False):
        names = _names(args[0] if args else kwargs["backends"])
        if not _followed(names):
            return _cpu_only(wrapped(*args, **kwargs), names)
    return wrapped(*args, **kwargs)


def _attention(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    orders = getattr(_UNFOLLOWED, "orders", None)
    if orders:
        query = args[0] if args else kwargs["query"]
        if query.device.type != "cpu":
            _refuse(orders[-1], f" on a {query.device.type} tensor")
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.nn.attention")
def add_set_priority(patcher: Patcher, attention: Any) -> bool:
    if "set_priority" in inspect.signature(attention.sdpa_kernel).parameters:
        return False
    import torch.nn.functional as F

    patcher.wrap(attention, "sdpa_kernel", _sdpa_kernel)
    patcher.wrap(F, "scaled_dot_product_attention", _attention)
    return True

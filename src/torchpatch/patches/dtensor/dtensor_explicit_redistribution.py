"""dtensor-explicit-redistribution: ``torch.distributed.tensor._utils.ExplicitRedistributionContext``
on torch 2.4-2.9.

What breaks:   the spmd_types package (0.2.3; torchtitan 0.3.0 imports it everywhere) imports it at
               module level in its type checker and dies on torch 2.4-2.9 with ``ImportError: cannot import
               name 'ExplicitRedistributionContext' from 'torch.distributed.tensor._utils'``.
Torch:         2.10 added the context: while one is active, DTensor's dispatch reports each implicit
               redistribution of an operator's arguments (``strict=False``: only those that communicate,
               ``redistribute_cost > 0``; ``strict=True``: any) by raising ``RuntimeError`` (``mode="raise"``)
               or logging a warning (``mode="warn"``); ``enable=False`` turns it off inside an enabled
               region. 2.4-2.9's ``OpDispatcher.redistribute_local_args`` redistributes without asking
               (the same static method, the same ``OpInfo`` fields; tested on 2.4.1 and 2.9.0).
Fix:           serve the class with 2.15's constructor, errors and thread-local nesting, and wrap this torch's
               ``OpDispatcher.redistribute_local_args`` so that, with a context active, each argument
               whose spec differs from the one the sharding strategy asks for is observed first, as
               2.15's dispatch does. Not observed: the redistribution in ``DTensor.from_local``'s
               backward (2.15 observes it too; 2.9's is inside torch's autograd function).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/tensor/_utils.py
"""

import logging
import threading
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dtensor-explicit-redistribution",
    summary="torch.distributed.tensor._utils.ExplicitRedistributionContext: DTensor's implicit redistributions "
    "raise or warn inside it (torch 2.10's)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/tensor/_utils.py",
)

logger = logging.getLogger(__name__)


class ExplicitRedistributionContext:
    """Inside it, DTensor's implicit redistributions raise (``mode="raise"``) or warn (``"warn"``):
    those that communicate, or all with ``strict=True``; ``enable=False`` allows them again."""

    _local = threading.local()

    def __init__(self, enable: bool = True, strict: bool = False, mode: str = "raise") -> None:
        if mode not in ("raise", "warn"):
            raise RuntimeError(f"Invalid mode {mode}")
        self._enable, self._strict = enable, strict
        self._raise_on_redistribution = mode == "raise"

    @classmethod
    def observe_redistribution(cls, src_spec: Any, dst_spec: Any, redistribution_msg: Any) -> None:
        """Raise or warn with ``redistribution_msg`` when the active context forbids ``src_spec`` ->
        ``dst_spec``."""
        active = getattr(cls._local, "_active", None)
        if active is None or not active._enable:
            return
        if not active._strict:
            try:
                from torch.distributed.tensor._collective_utils import redistribute_cost
            except ImportError:  # torch 2.4
                from torch.distributed._tensor._collective_utils import redistribute_cost

            if redistribute_cost(src_spec, dst_spec) <= 0:
                return
        if active._raise_on_redistribution:
            raise RuntimeError(str(redistribution_msg))
        logger.warning(str(redistribution_msg))

    def __enter__(self) -> "ExplicitRedistributionContext":
        self._prev = getattr(ExplicitRedistributionContext._local, "_active", None)
        ExplicitRedistributionContext._local._active = self
        return self

    def __exit__(self, *exc: Any) -> None:
        ExplicitRedistributionContext._local._active = self._prev


def _context() -> type:
    ExplicitRedistributionContext.__module__ = "torch.distributed.tensor._utils"
    return ExplicitRedistributionContext


# torch 2.4's torch.distributed.tensor._utils is torch.distributed._tensor._utils itself (relocations)
for _home in ("torch.distributed.tensor._utils", "torch.distributed._tensor._utils"):
    PATCH.symbol(_home, "ExplicitRedistributionContext")(_context)


def _observing(redistribute_local_args: Callable[..., None]) -> Callable[..., None]:
    def observed(op_info: Any, suggested_input_schema: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(ExplicitRedistributionContext._local, "_active", None) is not None:
            _observe_args(op_info, suggested_input_schema)
        return redistribute_local_args(op_info, suggested_input_schema, *args, **kwargs)

    observed.__torchpatch_observed__ = True  # type: ignore[attr-defined]
    return observed


def _observe_args(op_info: Any, suggested_input_schema: Any) -> None:
    import torch.utils._pytree as pytree
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
    except ImportError:  # torch 2.4
        from torch.distributed._tensor.placement_types import DTensorSpec

    targets: Tuple[Any, ...] = suggested_input_schema.args_schema
    if op_info.args_tree_spec is not None:
        targets = tuple(pytree.tree_leaves(targets))
    subject = op_info.schema if op_info.schema is not None else suggested_input_schema.op
    for spec, target in zip(op_info.flat_args_schema, targets):
        if isinstance(spec, DTensorSpec) and spec != target:
            ExplicitRedistributionContext.observe_redistribution(
                spec, target, f"Implicit redistribution occurred for {subject} while ExplicitRedistributionContext was active")


def observe_in_dispatch(patcher: Patcher, dispatch: ModuleType) -> Optional[bool]:
    owner = dispatch.OpDispatcher
    current = vars(owner).get("redistribute_local_args")
    if not isinstance(current, staticmethod) or getattr(current.__func__, "__torchpatch_observed__", False):
        return False  # not this dispatcher, or observed already (2.4: one module under two names)
    patcher.setattr(owner, "redistribute_local_args", staticmethod(_observing(owner.redistribute_local_args)))
    return True


# torch 2.4's dispatcher is torch.distributed._tensor._dispatch (the other name is relocations' alias of it)
for _dispatch in ("torch.distributed.tensor._dispatch", "torch.distributed._tensor._dispatch"):
    PATCH.on_import(_dispatch)(observe_in_dispatch)

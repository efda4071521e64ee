"""checkpoint-early-stop: ``torch.utils.checkpoint.checkpoint(..., early_stop=...)``, a per-call
switch of the recomputation's early stop, on torch 2.4-2.8.

What breaks:   torchtitan 0.2.2 and 0.3 wrap each block with ``checkpoint_wrapper(block, ...,
               early_stop=...)`` (full and selective activation checkpointing). Before torch 2.9,
               ``checkpoint`` has no such parameter: non-reentrant checkpointing hands it to the block,
               whose first forward dies with ``TypeError: TransformerBlock.forward() got an unexpected
               keyword argument 'early_stop'``; reentrant checkpointing refuses it (``ValueError:
               Unexpected keyword arguments: early_stop``).
Torch:         2.4-2.8 have only the global ``set_checkpoint_early_stop(enable)`` context (early stop
               on by default); 2.9 added the keyword (default True; a ``set_checkpoint_early_stop``
               context around the call, where there is one, decides instead).
Fix:           as torch 2.9: ``checkpoint`` takes ``early_stop`` (keyword). With
               ``use_reentrant=False`` it is the early stop of that call's own recomputation frame
               (made when the call starts, before the function runs: checkpoints nested in the
               function keep theirs), unless a ``set_checkpoint_early_stop`` context is open, which
               decides as on 2.9; reentrant checkpointing ignores it, as 2.9 does. A call without
               it is this torch's.
Upstream:      https://github.com/pytorch/pytorch/pull/160781
"""

import contextlib
import inspect
from types import ModuleType
from typing import Any, Dict, Iterator, List, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="checkpoint-early-stop",
    summary="torch.utils.checkpoint.checkpoint(..., early_stop=...) and checkpoint_wrapper(..., early_stop=...): "
            "the recomputation's early stop per call (an open set_checkpoint_early_stop context wins, as 2.9)",
    torch=">=2.4,<2.9",
    upstream="https://github.com/pytorch/pytorch/pull/160781",
    behaviour="checkpoint(..., early_stop=...)",
    errors=(  # the keyword reaches the checkpointed function (non-reentrant), or reentrant refuses it
        Error(r"got an unexpected keyword argument 'early_stop'",
              "TypeError: TransformerBlock.forward() got an unexpected keyword argument 'early_stop'"),
        Error(r"Unexpected keyword arguments: (.*,)?early_stop\b", "ValueError: Unexpected keyword arguments: early_stop"),
    ),
)

_OPEN: List[bool] = []  # the set_checkpoint_early_stop contexts open now, innermost last
_PENDING: List[bool] = []  # the early_stop of a checkpoint call whose frame is not made yet


def _set_early_stop(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    @contextlib.contextmanager
    def context() -> Iterator[None]:
        with wrapped(*args, **kwargs):
            _OPEN.append(True)
            try:
                yield
            finally:
                _OPEN.pop()

    return context()


def _checkpoint(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if "early_stop" not in kwargs:
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    early_stop = bool(kwargs.pop("early_stop"))
    if kwargs.get("use_reentrant") is not False or _OPEN:
        return wrapped(*args, **kwargs)  # reentrant ignores it; an open context decides
    _PENDING.append(early_stop)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _PENDING.clear()  # taken by the call's frame (or the call failed before making one)


def _frame_init(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    if _PENDING:
        args = (args[0], _PENDING.pop(), *args[2:])  # (recompute_fn, early_stop, ...)
    wrapped(*args, **kwargs)


@PATCH.on_import("torch.utils.checkpoint")
def add_early_stop(patcher: Patcher, checkpoint: ModuleType) -> bool:
    if "early_stop" in inspect.signature(checkpoint.checkpoint).parameters:
        return False
    params = list(inspect.signature(checkpoint._CheckpointFrame.__init__).parameters)
    if params[1:3] != ["recompute_fn", "early_stop"]:
        raise RuntimeError(f"torch.utils.checkpoint._CheckpointFrame.__init__{tuple(params)}: not the "
                           "(self, recompute_fn, early_stop, ...) of torch 2.4-2.8, so early_stop cannot be set per call")
    patcher.wrap(checkpoint, "checkpoint", _checkpoint)
    patcher.wrap(checkpoint, "set_checkpoint_early_stop", _set_early_stop)
    patcher.wrap(checkpoint._CheckpointFrame, "__init__", _frame_init)
    return True


@PATCH.on_import("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
def wrapper_binding(patcher: Patcher, module: ModuleType) -> bool:
    """``checkpoint_wrapper`` holds ``checkpoint`` under its own name, bound when it was imported."""
    import torch.utils.checkpoint as checkpoint

    bound = getattr(module, "torch_utils_checkpoint", None)
    if bound is None or bound is checkpoint.checkpoint or "early_stop" in inspect.signature(bound).parameters:
        return False
    patcher.setattr(module, "torch_utils_checkpoint", checkpoint.checkpoint)
    return True

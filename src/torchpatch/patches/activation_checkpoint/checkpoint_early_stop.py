"""checkpoint-early-stop: ``torch.utils.checkpoint.checkpoint(..., early_stop=...)`` (and
``checkpoint_wrapper(module, early_stop=...)``) on torch 2.4-2.8.

What breaks:   torchtitan 0.2.2 wraps each transformer block for activation checkpointing with
               ``checkpoint_wrapper(block, ..., early_stop=ac_config.early_stop)``; torch 2.4's
               ``checkpoint`` has no such keyword and hands it to the block, so every run with
               activation checkpointing (``fsdp+tp+sac``) stops in the first forward with ``TypeError:
               TransformerBlock.forward() got an unexpected keyword argument 'early_stop'``.
Torch:         2.9 added the keyword (default True) for non-reentrant checkpointing: whether the
               recomputation in backward stops once it has recomputed every tensor backward needs, the
               setting 2.4 takes from ``set_checkpoint_early_stop`` alone (a global, True by default).
               From 2.9 that context manager, where one is open, overrides the keyword; reentrant
               checkpointing ignores it.
Fix:           the keyword is taken out of the call, and while the call builds its checkpoint frame
               (where 2.4 reads the setting) the setting is the keyword's, unless a
               ``set_checkpoint_early_stop`` context is open (2.9's precedence). The values computed
               are the same either way; early stopping only spares recomputation.
Upstream:      https://github.com/pytorch/pytorch/pull/160781 (early_stop kwarg to torch.utils.checkpoint)
"""

import inspect
import sys
from types import ModuleType
from typing import Any, Dict, List, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="checkpoint-early-stop",
    summary="torch.utils.checkpoint.checkpoint(..., early_stop=) and checkpoint_wrapper(..., early_stop=) on "
            "torch 2.4-2.8 (2.9's precedence: an open set_checkpoint_early_stop context wins)",
    torch=">=2.4,<2.9",
    upstream="https://github.com/pytorch/pytorch/pull/160781",
    behaviour="checkpoint(..., early_stop=...)",
    errors=(  # the keyword reaches the checkpointed function (non-reentrant), or reentrant refuses it
        Error(r"got an unexpected keyword argument 'early_stop'",
              "TypeError: TransformerBlock.forward() got an unexpected keyword argument 'early_stop'"),
        Error(r"Unexpected keyword arguments: (.*,)?early_stop\b", "ValueError: Unexpected keyword arguments: early_stop"),
    ),
)
MODULE = "torch.utils.checkpoint"
WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"

_open: List[int] = [0]  # set_checkpoint_early_stop contexts open now


class _Counted:
    """A ``set_checkpoint_early_stop`` context, counted while open."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def __enter__(self) -> Any:
        result = self._context.__enter__()
        _open[0] += 1
        return result

    def __exit__(self, *exc: Any) -> Any:
        _open[0] -= 1
        return self._context.__exit__(*exc)


def _set_early_stop(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    return _Counted(wrapped(*args, **kwargs))


def _checkpoint(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    early_stop = bool(kwargs.pop("early_stop", True))
    module = sys.modules[MODULE]
    if _open[0]:  # an open context overrides the keyword (2.9)
        return wrapped(*args, **kwargs)
    previous = module._enable_checkpoint_early_stop
    module._enable_checkpoint_early_stop = early_stop
    try:
        return wrapped(*args, **kwargs)
    finally:
        module._enable_checkpoint_early_stop = previous


def _lacks_keyword(function: Any) -> bool:
    return callable(function) and "early_stop" not in inspect.signature(function).parameters


@PATCH.on_import(MODULE)
def keyword(patcher: Patcher, module: ModuleType) -> bool:
    if not _lacks_keyword(getattr(module, "checkpoint", None)) or not hasattr(module, "_enable_checkpoint_early_stop"):
        return False
    patcher.wrap(module, "checkpoint", _checkpoint)
    patcher.wrap(module, "set_checkpoint_early_stop", _set_early_stop)
    return True


@PATCH.on_import(WRAPPER)
def wrapper_keyword(patcher: Patcher, module: ModuleType) -> bool:
    """checkpoint_wrapper binds torch.utils.checkpoint's function at its import."""
    own = getattr(module, "torch_utils_checkpoint", None)
    if not _lacks_keyword(own) or own is getattr(sys.modules.get(MODULE), "checkpoint", None):
        return False
    patcher.wrap(module, "torch_utils_checkpoint", _checkpoint)
    return True

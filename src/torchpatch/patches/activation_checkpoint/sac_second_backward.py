"""sac-second-backward: a second backward through a selective activation checkpoint (SAC) region
hands back another op's cached output, torch 2.4-2.12.

What breaks:   with ``checkpoint(fn, ..., use_reentrant=False, context_fn=<SAC>)`` (torch 2.5+'s
               ``create_selective_checkpoint_contexts``, torch 2.4's private
               ``_pt2_selective_checkpoint_context_fn_gen``), each recomputation takes the saved
               outputs of an op with ``list.pop(0)``. A recomputation that stops early (the default:
               it stops once every tensor backward needs is back) leaves the outputs of the op's
               later calls in the list, so the next recomputation of the region (a second
               ``torch.autograd.grad``/``backward`` with ``retain_graph=True``, a split
               input/weight backward) starts from those: the first matmul gets the last matmul's
               output and the gradients come out wrong, without an error. Where the list is empty
               instead, torch raises "Trying to backward an extra time", SAC's documented answer.
Torch:         2.4 (private API) to 2.12: the storage is a list per op popped from the front
               (read in 2.4.1's and 2.9.0's ``torch/utils/checkpoint.py``; reproduced on both);
               2.13 keys saved outputs by the op's call index, reset at each recomputation, and
               marks them consumed, so any second recomputation raises (2.13.0, 2.14.1, 2.15.0).
Fix:           the recomputation mode of SAC (``_CachedTorchDispatchMode``) sees the shared storage
               through a view whose per-op ``pop(0)`` hands back the op's n-th saved output for its
               n-th call in this recomputation (the count restarts when the mode is entered, once
               per recomputation) and marks it consumed; a consumed or missing entry answers as an
               empty list, so torch's own check raises "Trying to backward an extra time" (2.4's
               pop raises the same error from here). The forward (caching) mode and the policy
               calls are torch's own. Applied where ``torch.utils.checkpoint`` lacks 2.13's
               ``_CONSUMED`` marker and has the pop-based mode.
Upstream:      https://github.com/pytorch/pytorch/pull/176450 (indexed SAC storage, in torch 2.13)
"""

from collections import defaultdict
from types import ModuleType
from typing import Any, Dict, Iterator, List, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="sac-second-backward",
    summary="selective activation checkpointing: a second recomputation raises instead of reusing "
            "other calls' saved outputs",
    torch=">=2.4,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/176450",
    behaviour="SAC recomputation takes saved outputs by call index, once",
    category="correctness",
)

_CONSUMED = object()  # a saved output already handed back
_EXTRA = ("Trying to backward an extra time. You are only allowed to backward once "
          "on any region computed under selective activation checkpoint.")


class _Entries:
    """One op's saved outputs as one recomputation sees them: ``pop(0)`` gives the op's n-th
    saved output at its n-th call and marks it consumed; ``len`` is 0 once that is impossible."""

    def __init__(self, view: "_IndexedStorage", func: Any, saved: List[Any]) -> None:
        self._view, self._func, self._saved = view, func, saved

    def _next(self) -> int:
        return self._view.taken[self._func]

    def __len__(self) -> int:
        i = self._next()
        return len(self._saved) - i if i < len(self._saved) and self._saved[i] is not _CONSUMED else 0

    def __bool__(self) -> bool:
        return True  # an existing entry list, as torch's ``storage.get(func) is None`` test expects

    def pop(self, index: int = -1) -> Any:
        if index != 0 or len(self) == 0:
            raise RuntimeError(_EXTRA)
        i = self._next()
        self._view.taken[self._func] += 1
        entry, self._saved[i] = self._saved[i], _CONSUMED
        return entry


class _IndexedStorage:
    """The SAC storage (op -> saved outputs, filled by the forward mode) as the recomputation mode
    reads it: ``get``, ``in`` and ``[]`` of torch 2.4-2.12's ``_CachedTorchDispatchMode``."""

    def __init__(self, storage: Dict[Any, List[Any]]) -> None:
        self.storage = storage
        self.taken: Dict[Any, int] = defaultdict(int)

    def restart(self) -> None:
        self.taken.clear()

    def get(self, func: Any, default: Any = None) -> Any:
        saved = self.storage.get(func)
        return default if saved is None else _Entries(self, func, saved)

    def __getitem__(self, func: Any) -> _Entries:
        return _Entries(self, func, self.storage[func])

    def __contains__(self, func: Any) -> bool:
        return func in self.storage

    def __iter__(self) -> Iterator[Any]:
        return iter(self.storage)

    def __len__(self) -> int:
        return len(self.storage)


def _init(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    wrapped(*args, **kwargs)
    if not isinstance(instance.storage, _IndexedStorage):
        instance.storage = _IndexedStorage(instance.storage)


def _enter(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    storage = getattr(instance, "storage", None)
    if isinstance(storage, _IndexedStorage):
        storage.restart()  # the mode is entered once per recomputation of the region
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.utils.checkpoint")
def index_saved_outputs(patcher: Patcher, checkpoint: ModuleType) -> bool:
    cached = getattr(checkpoint, "_CachedTorchDispatchMode", None)
    if cached is None or hasattr(checkpoint, "_CONSUMED"):
        return False  # no eager SAC (torch < 2.4), or 2.13's indexed storage
    patcher.wrap(cached, "__init__", _init)
    patcher.wrap(cached, "__enter__", _enter)
    return True

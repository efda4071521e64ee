"""sac-cache-mutation: an output that selective activation checkpointing (SAC) saved, then
modified in place later in the forward pass, is handed back modified to the recomputation, torch 2.4.

What breaks:   torch 2.4's SAC (``checkpoint(..., use_reentrant=False,
               context_fn=lambda: _pt2_selective_checkpoint_context_fn_gen(policy))``, torchtitan's
               selective op checkpointing at the time) caches the saved ops' outputs as detached
               aliases. When the forward then modifies such an output in place
               (``y = x @ w; y.mul_(2); y.sin()``), the recomputation gets the already-modified
               tensor, applies the in-place op again and saves that for backward: the gradients
               are wrong (here of ``sin(4 x w)`` instead of ``sin(2 x w)``), without an error.
Torch:         2.4 (eager SAC arrived there, private); torch 2.5 made SAC public and checks each
               cached tensor's version counter, raising "Tensor cached during selective activation
               checkpoint has been mutated" (read in 2.4.1's and 2.9.0's
               ``torch/utils/checkpoint.py``; reproduced on 2.4.1, 2.9.0 and 2.13.0 raise).
Fix:           the forward (caching) mode stores aliases that share the outputs' version counters
               (2.4's plain ``detach`` below autograd gets a counter of its own, so no check could
               see the change) and records the counters; the recomputation mode compares them when it takes the entry and raises torch 2.5's
               error when one moved (2.5's ``allow_cache_entry_mutation=True`` opt-out has no
               counterpart in 2.4's private API). Applied where ``torch.utils.checkpoint`` has 2.4's
               ``push_into_storage``/``pop_from_storage`` and lacks 2.5's ``_VersionWrapper``.
Upstream:      https://github.com/pytorch/pytorch/pull/125795 (SAC cleaned up and made public, with
               the cache mutation check, torch 2.5)
"""

from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="sac-cache-mutation",
    summary="torch 2.4 selective activation checkpointing raises, as 2.5 does, when a cached output "
            "was modified in place instead of recomputing from it",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/125795",
    behaviour="SAC checks cached outputs' version counters",
    category="correctness",
)

_MUTATED = "Tensor cached during selective activation checkpoint has been mutated"


class _Versioned:
    """A stored SAC entry and the version counters its tensors had when stored."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.versions = self._versions(value)

    @staticmethod
    def _versions(value: Any) -> List[Optional[int]]:
        import torch
        from torch.utils._pytree import tree_flatten

        leaves, _ = tree_flatten(value)
        return [leaf._version if isinstance(leaf, torch.Tensor) else None for leaf in leaves]

    def checked(self) -> Any:
        if self._versions(self.value) != self.versions:
            raise RuntimeError(_MUTATED)
        return self.value


def _aliased(x: Any) -> Any:
    """``x.detach()`` that shares x's version counter: below autograd (in a dispatch mode) a plain
    detach skips the ADInplaceOrView kernel and gets a counter of its own (torch 2.5 detaches
    this way too)."""
    import torch

    if not isinstance(x, torch.Tensor):
        return x
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return x.detach()


def _push(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    from torch.utils._pytree import tree_map

    result = wrapped(*args, **kwargs)
    out = args[0] if args else kwargs["out"]
    func = args[1] if len(args) > 1 else kwargs["func"]
    # replace what push_into_storage just appended (torch's detached copy of ``out``)
    instance.storage[func][-1] = _Versioned(tree_map(_aliased, out))
    return result


def _pop(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    entry = wrapped(*args, **kwargs)
    return entry.checked() if isinstance(entry, _Versioned) else entry


@PATCH.on_import("torch.utils.checkpoint")
def check_cached_versions(patcher: Patcher, checkpoint: ModuleType) -> bool:
    caching = getattr(checkpoint, "_CachingTorchDispatchMode", None)
    cached = getattr(checkpoint, "_CachedTorchDispatchMode", None)
    if (caching is None or cached is None or hasattr(checkpoint, "_VersionWrapper")
            or not hasattr(caching, "push_into_storage") or not hasattr(cached, "pop_from_storage")):
        return False  # no eager SAC, or torch 2.5+'s, which checks versions itself
    patcher.wrap(caching, "push_into_storage", _push)
    patcher.wrap(cached, "pop_from_storage", _pop)
    return True

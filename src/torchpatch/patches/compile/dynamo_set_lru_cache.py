"""dynamo-set-lru-cache: ``torch._C._dynamo.eval_frame._set_lru_cache(enabled)`` on torch 2.4-2.9.

What breaks:   torchtitan 0.2.2 turns Dynamo's most-recently-used ordering of compiled graphs off
               whenever it applies activation checkpointing (``torch._C._dynamo.eval_frame.
               _set_lru_cache(False)``, for SAC over wrapped Inductor regions); on torch 2.9 every
               checkpointed run dies with ``AttributeError: module 'torch._C._dynamo.eval_frame' has
               no attribute '_set_lru_cache'``.
Torch:         2.4-2.9; 2.10 added the switch (default True: a frame's cache moves the entry that
               hit to the front; False keeps insertion order, so the first valid graph runs).
Fix:           serve it: it records the setting and returns the previous one, as torch 2.15's does
               (2.10-2.14's return None), and
               changes nothing else: these torches always keep the most recently used order. The
               order only decides which of several valid compiled graphs of one frame runs first,
               each computing the frame's function; the case torchtitan guards against (a SAC cache
               of a wrapped Inductor region's outputs from another graph) cannot arise here, where
               Inductor never wraps its regions (inductor-wrap-compiled-regions says why).
Upstream:      https://github.com/pytorch/pytorch/issues/166926 (why torchtitan turns it off)
"""

from types import ModuleType
from typing import List

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dynamo-set-lru-cache",
    summary="torch._C._dynamo.eval_frame._set_lru_cache(enabled) (torch 2.10's switch): records it, returns the "
            "previous setting",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/issues/166926",
)

_enabled: List[bool] = [True]


def _set_lru_cache(enabled: bool) -> bool:
    """Set whether Dynamo reorders a frame's compiled graphs by use; returns the previous setting
    (recorded only: this torch always reorders them)."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    return previous


EVAL_FRAME = "torch._C._dynamo.eval_frame"
PATCH.sets(EVAL_FRAME, ("_set_lru_cache",))


@PATCH.on_import("torch")
def serve_switch(patcher: Patcher, torch: ModuleType) -> bool:
    """Set as a plain attribute: torch builds this extension module itself, without an import that
    would give it a served ``__getattr__``."""
    eval_frame = torch._C._dynamo.eval_frame
    if hasattr(eval_frame, "_set_lru_cache"):
        return False
    patcher.setattr(eval_frame, "_set_lru_cache", _set_lru_cache)
    return True

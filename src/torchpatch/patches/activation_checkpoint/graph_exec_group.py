"""graph-exec-group: ``torch.utils.checkpoint.GraphExecGroup`` on torch 2.4-2.9.

What breaks:   code written for torch 2.10+ that runs several backward calls over disjoint parts of
               one graph (``with GraphExecGroup(): ...``, e.g. pipeline schedules that split the
               input and weight gradients) dies on torch 2.4-2.9 with ``ImportError: cannot import
               name 'GraphExecGroup' from 'torch.utils.checkpoint'``.
Torch:         2.4-2.9: non-reentrant checkpoint keys its recomputation by the running backward
               call (``torch._C._current_graph_task_id()``), so every backward call that reaches a
               checkpointed region recomputes it again; 2.10 added the group.
Fix:           serve ``GraphExecGroup`` as in torch 2.15: a context manager under which every backward
               call reaches each checkpointed region under one recomputation key, so a region is
               recomputed at most once for the whole group; nesting raises torch's
               ``RuntimeError``; unpacking a saved tensor twice within a group raises torch's
               ``CheckpointError`` with 2.15's sentence on overlapping backward calls. To that end
               ``torch.utils.checkpoint._checkpoint_hook`` is replaced by a subclass whose unpack
               hook keys by the active group (the same steps as torch's own hook otherwise). The
               active group is process-wide (torch 2.15 keeps it per thread and hands it to the
               autograd engine's threads), so the backward threads of CUDA see it; use one group
               at a time per process.
Upstream:      https://github.com/pytorch/pytorch/pull/166536 (torch 2.10)
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any, Optional

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="graph-exec-group",
    summary="torch.utils.checkpoint.GraphExecGroup (one recomputation per checkpointed "
            "region for several backward calls)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/166536",
    behaviour="non-reentrant checkpoint recomputes once per GraphExecGroup",
)

_MODULE = "torch.utils.checkpoint"
_current: Optional["GraphExecGroup"] = None
_OVERLAP = ("Performing two backward calls that overlap (i.e. require the same saved activation in order to "
            "compute gradients) is not allowed while under the torch.utils.checkpoint.GraphExecGroup context. ")


class GraphExecGroup:
    """Checkpointed regions reached by backward calls under one instance of this context manager are
    recomputed at most once, however many backward calls reach them. The backward calls must use
    disjoint saved activations, even with ``retain_graph=True``. Only non-reentrant checkpoint is
    affected."""

    def __enter__(self) -> "GraphExecGroup":
        global _current
        if _current is not None:
            raise RuntimeError(f"GraphExecGroup contexts cannot be nested. Already inside group {_current}")
        _current = self
        return self

    def __exit__(self, *args: object) -> None:
        global _current
        _current = None

    @classmethod
    def _get_current_group(cls) -> Optional["GraphExecGroup"]:
        return _current


GraphExecGroup.__module__ = _MODULE


def _grouped_hook(checkpoint: ModuleType) -> type:
    """``checkpoint._checkpoint_hook`` whose unpack hook keys recomputation by the active group."""
    import torch

    # torch 2.9 runs the recomputation with dynamo disabled; 2.4-2.8 call it directly
    run = getattr(checkpoint, "_run_fn_with_dynamo_disabled", lambda fn, *args: fn(*args))

    class _checkpoint_hook(checkpoint._checkpoint_hook):
        def __init__(self, frame: Any) -> None:
            super().__init__(frame)
            ungrouped = self.unpack_hook

            def unpack_hook(holder: Any) -> Any:
                gid = _current
                if gid is None:
                    return ungrouped(holder)
                try:
                    return unpack(frame, holder, gid)
                except checkpoint.CheckpointError as error:
                    if frame.unpack_error_cb is None:
                        raise
                    frame.unpack_error_cb(error)

            self.unpack_hook = unpack_hook

    def unpack(frame: Any, holder: Any, gid: Any) -> Any:
        if not frame.is_recomputed[gid]:
            ctx = frame.input_saver.grad_fn
            args = ctx.get_args(ctx.saved_tensors)
            try:
                with checkpoint._recomputation_hook(weakref.ref(frame), gid), torch.autograd.enable_grad():
                    run(frame.recompute_fn, *args)
            except checkpoint._StopRecomputationError:
                pass
            frame.is_recomputed[gid] = True
            frame.check_recomputed_tensors_match(gid)
        checkpoint._internal_assert(gid in holder.handles)
        if holder.handles[gid] is None:
            raise checkpoint.CheckpointError(
                "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. "
                f"{_OVERLAP}If you are calling ctx.saved_tensors in backward, make sure to do so only once. "
                "Otherwise please open an issue with details on your use case.")
        checkpoint._internal_assert(holder.handles[gid] in frame.recomputed[gid])
        value = frame.recomputed[gid][holder.handles[gid]]
        holder.handles[gid] = None
        return value

    return _checkpoint_hook


PATCH.sets(_MODULE, ["GraphExecGroup"])


@PATCH.on_import(_MODULE)
def _serve(patcher: Patcher, checkpoint: ModuleType) -> bool:
    if hasattr(checkpoint, "GraphExecGroup"):
        return False
    patcher.setattr(checkpoint, "GraphExecGroup", GraphExecGroup)
    patcher.setattr(checkpoint, "_checkpoint_hook", _grouped_hook(checkpoint))
    return True

"""pipelining-runtime-dw-scale: ``_PipelineScheduleRuntime`` (``ScheduleDualPipeV``, CSV/action-list
schedules) divides the gradients by the number of microbatches when a stage's last backward is a
weight backward (``W``), torch 2.7-2.9.

What breaks:   with ``scale_grads=True`` (the default) a schedule divides each stage's gradients by
               ``n_microbatches`` after the stage's last backward of the step, so the gradients are
               those of the mean of the microbatch losses. ``_PipelineScheduleRuntime`` does it after
               a full backward (``B``) only: a stage whose last backward is a weight backward (``W``,
               the zero-bubble split) keeps the *sum* over the microbatches. ``ScheduleDualPipeV``
               on 2 ranks, 4 stages, 4 microbatches: stages 0, 1 and 2 get gradients exactly 4x the
               single-process mean-loss gradients, stage 3 (its last backward is a ``B``) the right
               ones; no error, the optimizer steps with 4x gradients on most stages (with Adam the
               clipping norm and weight decay balance shift). Same for torchtitan's CSV schedules
               with ``I``/``W`` actions.
Torch:         2.7 (``scale_grads`` came with torch 2.7) to 2.9: the ``BACKWARD_WEIGHT`` branch of
               ``_PipelineScheduleRuntime._step_microbatches`` counts the backward but never calls
               ``stage.scale_grads`` (read in 2.9.0's source and reproduced there). torch 2.10
               scales there (#164777), and 2.13+ run a ``REDUCE_GRAD`` action after every stage's
               last backward. The hook reads the runtime's source: it applies only where the ``W``
               branch does not scale and there is no ``REDUCE_GRAD`` action.
Fix:           while a ``_PipelineScheduleRuntime`` runs ``_step_microbatches``, a stage's
               ``backward_weight_one_chunk(..., last_backward=True)`` is followed by
               ``stage.scale_grads(n_microbatches if scale_grads else 1)``, as the ``B`` branch does
               (and as torch 2.10 does after ``W``). Other schedules (``PipelineScheduleMulti``'s own
               loop scales after ``W`` already) and other callers are unchanged.
Upstream:      https://github.com/pytorch/pytorch/pull/164777 ("Fixed a gradient scaling issue for
               dWeight", torch 2.10)
"""

import inspect
import re
import threading
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._source import torch_source

PATCH = Patch(
    id="pipelining-runtime-dw-scale",
    summary="_PipelineScheduleRuntime / ScheduleDualPipeV scale gradients after a last weight backward (W)",
    torch=">=2.7,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/164777",
    behaviour="ScheduleDualPipeV / _PipelineScheduleRuntime with scale_grads=True",
    category="correctness",
)

_ACTIVE = threading.local()  # .schedule: the runtime whose _step_microbatches is running on this thread


def _weight_branch_scales(source: str) -> bool:
    """Whether the runtime's ``_step_microbatches`` source scales gradients after a ``W`` action (or
    leaves it to a ``REDUCE_GRAD`` action, as torch >= 2.13 does)."""
    if "REDUCE_GRAD" in source or "perform_reduce_grad" in source:
        return True
    match = re.search(r"==\s*(?:_ComputationType\.)?BACKWARD_WEIGHT\s*:(.*?)(?:\n\s*elif |\n\s*else\s*:)", source, re.S)
    if match is None:
        return True  # not the loop this patch knows: leave torch alone
    return "scale_grads" in match.group(1)


def _step_microbatches(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    previous = getattr(_ACTIVE, "schedule", None)
    _ACTIVE.schedule = instance
    try:
        return wrapped(*args, **kwargs)
    finally:
        _ACTIVE.schedule = previous


def _backward_weight_one_chunk(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    schedule = getattr(_ACTIVE, "schedule", None)
    last_backward = kwargs["last_backward"] if "last_backward" in kwargs else (args[1] if len(args) > 1 else False)
    if schedule is not None and last_backward:
        instance.scale_grads(schedule._n_microbatches if schedule.scale_grads else 1)
    return result


@PATCH.on_import("torch.distributed.pipelining.schedules")
def scale_after_weight_backward(patcher: Patcher, schedules: Any) -> bool:
    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    if runtime is None or "_step_microbatches" not in vars(runtime):
        return False
    if "scale_grads" not in inspect.signature(runtime.__init__).parameters:
        return False  # no scale_grads (torch < 2.7): the gradients are the sum by design
    if _weight_branch_scales(torch_source(runtime._step_microbatches)):
        return False  # torch already scales after the last W
    from torch.distributed.pipelining.stage import _PipelineStageBase

    patcher.wrap(runtime, "_step_microbatches", _step_microbatches)
    patcher.wrap(_PipelineStageBase, "backward_weight_one_chunk", _backward_weight_one_chunk)
    return True

"""pipelining-scale-grads: pipeline schedules take ``scale_grads=`` and, by default, give the gradients
of the mean of the microbatch losses, torch 2.4-2.6.

What breaks:   torch 2.7 made every pipeline schedule divide each stage's gradients by
               ``n_microbatches`` once all its microbatches are backwarded (``scale_grads=True``, the
               constructors' new default), so that they are the gradients of the mean microbatch loss,
               as one process computes over the whole batch; ``scale_grads=False`` keeps the sum.
               torch 2.4-2.6 always sum. Code written for 2.7+ either dies on the argument
               (``TypeError: __init__() got an unexpected keyword argument 'scale_grads'``) or, relying
               on the default (torchtitan 0.1.0), silently steps with ``n_microbatches`` times the
               gradient: torchtitan 0.1.0's PP on torch 2.4.1 (4 microbatches) has gradient norms
               4 times one process's; its losses stay close only because AdamW normalises.
Torch:         2.4-2.6 (torch 2.7 added ``scale_grads`` to the schedules and
               ``_PipelineStageBase.scale_grads``; read in the inventories and 2.7-2.15's sources).
               2.5 and 2.6 are not in CI's matrix: their schedules were read in the inventories only.
Fix:           every schedule constructor of torch's ``schedules`` module accepts ``scale_grads``
               (keyword, default True; in its signature too) and keeps it as
               ``schedule.scale_grads``; the schedules that run backwards (``ScheduleGPipe``,
               ``Schedule1F1B``, the ``PipelineScheduleMulti`` loop behind Interleaved1F1B, LoopedBFS and 2.5-2.6's zero-bubble schedules, and 2.5-2.6's
               ``_PipelineScheduleRuntime`` for CSV / action lists) call ``stage.scale_grads(n)``
               (``n`` = ``n_microbatches`` with ``scale_grads=True``, 1 with False) on each of the
               rank's stages after the step's backwards, as 2.15 does after a stage's last backward;
               a forward-only step (no ``loss_fn``, ``eval``) scales nothing. ``_PipelineStageBase``
               gets 2.7's ``scale_grads(grad_scale_factor)``: ``.grad`` of the stage module's
               parameters divided in place unless the factor is 1. The schedules served by
               ``pipelining-zbv``, ``pipelining-interleaved-zb`` and ``pipelining-dualpipev`` run
               their own loop, which scales already: they are left alone.
Upstream:      https://github.com/pytorch/pytorch/pull/144352 (``scale_grads``, torch 2.7)
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="pipelining-scale-grads",
    summary="pipeline schedules accept scale_grads= and divide gradients by the number of microbatches "
    "(mean microbatch loss, the default since torch 2.7)",
    torch=">=2.4,<2.7",
    upstream="https://github.com/pytorch/pytorch/pull/144352",
    behaviour="pipeline schedules' scale_grads (default True: gradients of the mean microbatch loss)",
    category="correctness",
)

SCHEDULES = "torch.distributed.pipelining.schedules"
STAGE = "torch.distributed.pipelining.stage"
# The classes of torch's schedules whose own ``_step_microbatches`` runs backwards (2.15 scales in each).
_STEPPING = ("ScheduleGPipe", "Schedule1F1B", "PipelineScheduleMulti", "_PipelineScheduleRuntime")

PATCH.sets(f"{STAGE}._PipelineStageBase", ("scale_grads",))


def scale_grads(self: Any, grad_scale_factor: int) -> None:
    """Divide the gradients of this stage's parameters by ``grad_scale_factor``: ``n_microbatches``
    for a loss function that averages, 1 (nothing to do) for one that sums. Call it once per step,
    after all the backwards."""
    if grad_scale_factor != 1:
        for p in self.submod.parameters():
            if p.grad is not None:
                p.grad.div_(grad_scale_factor)


def _accepting_scale_grads(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (a schedule's ``__init__``) with 2.7's ``scale_grads`` (a keyword, default True, kept as
    ``schedule.scale_grads``), in its signature too (code tells the averaging torch by it)."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, scale_grads: bool = True, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.scale_grads = scale_grads  # after the base's own __init__ (which set the default) returned

    signature = inspect.signature(init)
    params = list(signature.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter("scale_grads", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool))
    __init__.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return __init__


def _step_microbatches(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    if instance._has_backward:
        factor = instance._n_microbatches if getattr(instance, "scale_grads", True) else 1
        stages = instance._stages if hasattr(instance, "_stages") else [instance._stage]
        for stage in stages:
            stage.scale_grads(factor)
    return result


@PATCH.on_import(STAGE)
def stage_scale_grads(patcher: Patcher, stage: Any) -> bool:
    if hasattr(stage._PipelineStageBase, "scale_grads"):
        return False
    patcher.setattr(stage._PipelineStageBase, "scale_grads", scale_grads)
    return True


@PATCH.on_import(SCHEDULES)
def schedules_scale_grads(patcher: Patcher, schedules: Any) -> bool:
    base = schedules._PipelineSchedule
    if "scale_grads" in inspect.signature(base.__init__).parameters:
        return False
    own = [cls for cls in vars(schedules).values()
           if isinstance(cls, type) and issubclass(cls, base) and cls.__module__ == SCHEDULES]
    for cls in own:
        if "__init__" in vars(cls):
            patcher.setattr(cls, "__init__", _accepting_scale_grads(vars(cls)["__init__"]))
        if cls.__name__ in _STEPPING and "_step_microbatches" in vars(cls):
            patcher.wrap(cls, "_step_microbatches", _step_microbatches)
    return True

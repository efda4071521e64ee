"""pipelining-step-loss-kwargs: ``schedule.step(..., loss_kwargs={...})``, keyword arguments for the
loss function, on torch 2.4-2.12.

What breaks:   torchtitan 0.3 runs every pipeline step as ``pp_schedule.step(arg_mbs=..., kwarg_mbs=...,
               target_mbs=..., losses=losses, loss_kwargs={"global_valid_tokens": n}, ...)``. Before
               torch 2.13 ``loss_kwargs`` is no argument of ``step``: it is taken for a model keyword
               argument (``TypeError`` from the model's forward) or, with pre-split inputs, refused
               (``ValueError: Unexpected keyword arguments with pre-split inputs: loss_kwargs``).
Torch:         2.4-2.9 read (no ``loss_kwargs`` in ``schedules.py``); 2.13 has it; 2.10-2.12 are
               not determined here (where their ``step`` has it, nothing is changed).
Fix:           as torch 2.15: every schedule's ``step`` takes ``loss_kwargs`` (default None) and,
               for that step, the schedule's loss is ``loss_fn(output, target, **loss_kwargs)`` for
               every microbatch (``_compute_loss``); a step without it is this torch's.
Upstream:      torch 2.13 (``step(..., loss_kwargs=None)``, ``_compute_loss(output, target,
               loss_kwargs)``); https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/schedules.py
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

from .pipelining_presplit_inputs import schedules_with_step

PATCH = Patch(
    id="pipelining-step-loss-kwargs",
    summary="pipeline schedule step(..., loss_kwargs={...}): keyword arguments for the loss function",
    torch=">=2.4,<2.13",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/schedules.py",
    behaviour="PipelineSchedule.step(loss_kwargs=...)",
    errors=(
        Error(r"unexpected keyword argument 'loss_kwargs'",
              "TypeError: _forward_unimplemented() got an unexpected keyword argument 'loss_kwargs'"),
    ),
)

_KEPT = "_torchpatch_loss_kwargs"  # on the schedule, during a step given loss_kwargs


def _step(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    loss_kwargs = kwargs.pop("loss_kwargs", None)
    if loss_kwargs is None:
        return wrapped(*args, **kwargs)
    setattr(instance, _KEPT, dict(loss_kwargs))
    try:
        return wrapped(*args, **kwargs)
    finally:
        delattr(instance, _KEPT)


def _compute_loss(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    loss_kwargs = getattr(instance, _KEPT, None)
    if loss_kwargs is None:
        return wrapped(*args, **kwargs)
    output, target = args
    return instance._loss_fn(output, target, **loss_kwargs)


@PATCH.on_import("torch.distributed.pipelining.schedules")
def _patch(patcher: Patcher, schedules: ModuleType) -> bool:
    base = schedules._PipelineSchedule
    if "loss_kwargs" in inspect.signature(base.step).parameters:
        return False
    # armed after pipelining-presplit-inputs (catalogue order), so this wrapper is outside its check
    for cls in schedules_with_step(schedules):
        patcher.wrap(cls, "step", _step)
    patcher.wrap(base, "_compute_loss", _compute_loss)
    return True

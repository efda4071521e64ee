"""pipelining-presplit-inputs: ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, inputs the
caller already split into microbatches, on torch 2.4-2.13.

What breaks:   torchtitan 0.3 (September 2026) feeds its pipeline schedule per-microbatch inputs,
               ``pp_schedule.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs,
               losses=losses, ...)``. Before torch 2.14 those names are taken for model keyword
               arguments: the schedule splits an empty batch into one microbatch and every pipeline
               step dies with ``ValueError: Expecting 4 arg_mbs but got 1``.
Torch:         2.4-2.13 split whole-batch ``*args``/``**kwargs``/``target`` only; 2.14 added the
               pre-split form to ``step`` and ``eval``.
Fix:           a ``step`` given ``arg_mbs``, ``kwarg_mbs`` or ``target_mbs`` is checked as torch 2.14
               checks it (no whole-batch inputs beside them, one entry per microbatch, a tuple / a
               dict per microbatch; the same error messages), then runs this torch's own ``step``
               with those microbatches where it would have split the batch: its ``_split_inputs``
               returns them and its ``_step_microbatches`` receives ``target_mbs``, for that call only.
               A call without them is this torch's, unchanged. ``eval`` forwards its keyword
               arguments to ``step`` on these versions, so it takes the pre-split form too.
Upstream:      torch 2.14 (``PipelineScheduleSingle.step`` / ``PipelineScheduleMulti.step``:
               ``_get_microbatch_inputs``); https://github.com/pytorch/pytorch/tree/v2.14.1/torch/distributed/pipelining/schedules.py
"""

import inspect
from typing import Any, Callable, Dict, List, Set, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="pipelining-presplit-inputs",
    summary="pipeline schedule step(arg_mbs=..., kwarg_mbs=..., target_mbs=...) with pre-split microbatches",
    torch=">=2.4,<2.14",
    upstream="https://github.com/pytorch/pytorch/tree/v2.14.1/torch/distributed/pipelining/schedules.py",
    behaviour="PipelineSchedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)",
)

PRE_SPLIT = ("arg_mbs", "kwarg_mbs", "target_mbs")


def _check(schedule: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], model_kwargs: Dict[str, Any],
           pre_split: Dict[str, Any]) -> Tuple[list, list]:
    """torch 2.14's checks of a pre-split call; returns (arg_mbs, kwarg_mbs) with defaults filled."""
    if args:
        raise ValueError("When using pre-split inputs, pass pre-split positional inputs "
                         "through arg_mbs=... instead of positional args.")
    if model_kwargs:
        raise ValueError(f"Unexpected keyword arguments with pre-split inputs: {', '.join(sorted(model_kwargs))}. "
                         "Pass pre-split keyword inputs through kwarg_mbs=...")
    if kwargs.get("target") is not None:
        raise ValueError("When using pre-split inputs, pass pre-split targets through "
                         "target_mbs=... instead of target=...")
    arg_mbs, kwarg_mbs = schedule._check_inputs(pre_split["arg_mbs"], pre_split["kwarg_mbs"], pre_split["target_mbs"])
    for index, (arg_mb, kwarg_mb) in enumerate(zip(arg_mbs, kwarg_mbs)):
        if not isinstance(arg_mb, tuple):
            raise TypeError(f"arg_mbs must be a list of tuples, but arg_mbs[{index}] is a {type(arg_mb)}")
        if not isinstance(kwarg_mb, dict):
            raise TypeError(f"kwarg_mbs must be a list of dicts, but kwarg_mbs[{index}] is a {type(kwarg_mb)}")
    return arg_mbs, kwarg_mbs


def _stepper(own: Set[str]) -> Callable[..., Any]:
    """The wrapper of one class's ``step``; ``own`` its parameters (target, losses, return_outputs, ...
    of this torch), read once when the patch applies, not at every step."""

    def step(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        kwargs = dict(kwargs)
        pre_split = {name: kwargs.pop(name, None) for name in PRE_SPLIT}
        if all(value is None for value in pre_split.values()):
            return wrapped(*args, **kwargs)
        model_kwargs = {k: v for k, v in kwargs.items() if k not in own}
        arg_mbs, kwarg_mbs = _check(instance, args, kwargs, model_kwargs, pre_split)
        target_mbs = pre_split["target_mbs"]
        step_microbatches = instance._step_microbatches

        def split_inputs(args: Any, kwargs: Any = None) -> Tuple[list, list]:
            return arg_mbs, kwarg_mbs

        def with_targets(arg_mbs: Any, kwarg_mbs: Any, target_mbs_: Any, *rest: Any, **kw: Any) -> Any:
            return step_microbatches(arg_mbs, kwarg_mbs, target_mbs, *rest, **kw)

        instance._split_inputs, instance._step_microbatches = split_inputs, with_targets
        try:
            return wrapped(**kwargs)
        finally:
            del instance._split_inputs, instance._step_microbatches

    return step


def schedules_with_step(schedules: Any) -> List[type]:
    """The schedule classes of ``torch.distributed.pipelining.schedules`` that define ``step``."""
    base = schedules._PipelineSchedule
    return [cls for cls in vars(schedules).values()
            if isinstance(cls, type) and issubclass(cls, base) and "step" in vars(cls) and cls is not base]


@PATCH.on_import("torch.distributed.pipelining.schedules")
def accept_presplit_inputs(patcher: Patcher, schedules: Any) -> bool:
    if "arg_mbs" in inspect.signature(schedules._PipelineSchedule.step).parameters:
        return False
    owners = schedules_with_step(schedules)
    for cls in owners:
        patcher.wrap(cls, "step", _stepper(set(inspect.signature(vars(cls)["step"]).parameters)))
    return bool(owners)

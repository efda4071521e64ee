"""pipeline-stage-inference: ``PipelineStage`` without ``input_args`` on torch 2.4 (shapes learnt at
the first step).

What breaks:   code written for torch >= 2.5 (torchtitan 2025) builds its stages as
               ``PipelineStage(module, stage_index, num_stages, device, group=pp_group)`` and dies
               with ``TypeError: PipelineStage.__init__() missing 1 required positional argument:
               'input_args'``: torch 2.4 needs example inputs at construction.
Torch:         2.4. torch 2.5 infers the shapes at the first ``step()`` from the real microbatch.
Fix:           ``input_args`` becomes optional. A stage built without it does the shape-free part
               of torch 2.4's construction at once and the rest at the first ``step()`` of its
               schedule, before any microbatch runs: the first stage takes the first microbatch's
               tensors, every other stage receives its input shapes and dtypes from the previous
               stage (``send_object_list`` on the stage's group, in stage order); then each stage
               completes torch 2.4's own construction with those inputs (which runs the submodule
               once on empty tensors to size its outputs, as 2.4 does when ``output_args`` is not
               given) and its schedule's send/receive buffers are made. A stage given
               ``input_args`` is torch 2.4's, unchanged.
Upstream:      https://github.com/pytorch/pytorch/pull/136912 (shape inference, torch 2.5)
"""

import inspect
from typing import Any, Dict, List, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="pipeline-stage-inference",
    summary="PipelineStage without input_args (shapes learnt at the first step)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/136912",
    behaviour="PipelineStage(module, stage_index, num_stages, device, group=...)",
    errors=(
        Error(r"missing 1 required positional argument: 'input_args'",
              "TypeError: PipelineStage.__init__() missing 1 required positional argument: 'input_args'"),
    ),
)
PATCH.takes("torch.distributed.pipelining.stage.PipelineStage", ("input_args=None",))  # for ``torchpatch check``

_DEFERRED = "_torchpatch_deferred"  # stage attribute: what its construction still needs
_INFERRED = "_torchpatch_inferred"  # stage attribute: its shapes were learnt at the first step


def _stage_init(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    if bound.arguments.get("input_args") is not None:
        return wrapped(*args, **kwargs)
    import torch.distributed as dist
    from torch.distributed.pipelining.stage import _PipelineStageBase

    a = bound.arguments
    group = a.get("group")
    # torch >= 2.5 leaves the submodule where it is (it may be on the meta device until the caller
    # materialises it); 2.4 moved it to the stage's device here
    _PipelineStageBase.__init__(instance, a["submodule"], a["stage_index"], a["num_stages"], a["device"], group)
    instance.inputs, instance.outputs, instance.outputs_grad = [], [], []

    def global_rank(peer: int) -> int:
        return peer if group is None else dist.get_global_rank(group, peer)

    instance.prev_stage = global_rank((instance.group_rank - 1) % instance.group_size)
    instance.next_stage = global_rank((instance.group_rank + 1) % instance.group_size)
    setattr(instance, _DEFERRED, {"output_args": a.get("output_args"), "infra": []})
    return None


def _deferring(method: str) -> Any:
    """``_prepare_forward_infra``/``_prepare_backward_infra`` of a deferred stage: remembered, run
    once the stage is complete."""

    def call(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        deferred = getattr(instance, _DEFERRED, None)
        if deferred is None:
            return wrapped(*args, **kwargs)
        deferred["infra"].append((method, args, kwargs))
        return None

    return call


def _complete(stage: Any, inputs: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """The input-dependent part of torch 2.4's construction of ``stage``, then its buffers. As torch
    >= 2.5's shape inference, the outputs are sized by one forward without gradients on zeros
    shaped like the inputs (the microbatch's keyword arguments as they are)."""
    import torch
    from torch.distributed.pipelining.stage import _create_empty_tensors

    deferred = stage.__dict__.pop(_DEFERRED)
    stage.__dict__[_INFERRED] = True
    zeros = tuple(torch.zeros_like(t, device=stage.device) for t in inputs)
    stage.inputs = _create_empty_tensors(zeros, stage.device)
    if deferred["output_args"] is None:
        with torch.no_grad():
            outputs = stage.submod(*zeros, **kwargs)
        stage.outputs = _create_empty_tensors(outputs, stage.device)
    else:
        stage.outputs = _create_empty_tensors(deferred["output_args"], stage.device)
    stage._configure_outputs_meta(tuple(stage.outputs))
    for method, args, kw in deferred["infra"]:
        getattr(stage, method)(*args, **kw)


def _infer(stages: List[Any], first_args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Complete every deferred stage of this rank, in stage order, passing shapes and dtypes along
    the pipeline (``send_object_list`` on the stage's group, as torch 2.5 does)."""
    import torch
    import torch.distributed as dist

    for stage in sorted(stages, key=lambda s: s.stage_index):
        if getattr(stage, _DEFERRED, None) is None:
            continue
        if stage.is_first:
            inputs = tuple(first_args)
        else:
            received: List[Any] = [None]
            dist.recv_object_list(received, src=stage.prev_stage, group=stage.group)
            inputs = tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in received[0])
        _complete(stage, inputs, kwargs)
        if not stage.is_last:
            metas = [(tuple(t.shape), t.dtype) for t in stage.outputs]
            dist.send_object_list([metas], dst=stage.next_stage, group=stage.group)


def _schedule_step(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    stages = list(getattr(instance, "_stages", None) or [instance._stage])
    if any(getattr(s, _DEFERRED, None) is not None for s in stages):
        model_kwargs = {k: v for k, v in kwargs.items() if k not in ("target", "losses")}
        args_split, kwargs_split = instance._split_inputs(args, model_kwargs)
        _infer(stages, tuple(args_split[0]) if args_split else (), kwargs_split[0] if kwargs_split else {})
    return wrapped(*args, **kwargs)


def _validate_fwd_input(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """torch 2.4 takes keyword inputs for the tail of ``input_args``; a stage whose shapes were
    learnt has only positional inputs recorded, so with keyword inputs it skips the check, as
    torch >= 2.5 does."""
    if instance.__dict__.get(_INFERRED) and (args[1] if len(args) > 1 else kwargs.get("kwargs")):
        return None
    return wrapped(*args, **kwargs)


def _needs_input_args(stage: Any) -> bool:
    return inspect.signature(stage.PipelineStage.__init__).parameters["input_args"].default is inspect.Parameter.empty


@PATCH.on_import("torch.distributed.pipelining.stage")
def optional_input_args(patcher: Patcher, stage: Any) -> bool:
    if not _needs_input_args(stage):
        return False
    patcher.wrap(stage.PipelineStage, "__init__", _stage_init)
    for method in ("_prepare_forward_infra", "_prepare_backward_infra"):
        patcher.wrap(stage.PipelineStage, method, _deferring(method))
    patcher.wrap(stage.PipelineStage, "_validate_fwd_input", _validate_fwd_input)
    return True


@PATCH.on_import("torch.distributed.pipelining.schedules")
def infer_at_first_step(patcher: Patcher, schedules: Any) -> bool:
    import torch.distributed.pipelining.stage as stage

    if not _needs_input_args(stage):
        return False
    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        patcher.wrap(cls, "step", _schedule_step)
    return True

"""pipelining-stage-kwargs: the keyword inputs a schedule's ``step`` is given reach every stage's
module, not only the first's, on torch 2.4-2.5.

What breaks:   code written for torch >= 2.5 hands every pipeline stage the microbatch's keyword
               inputs (torchtitan 0.3: ``pp_schedule.step(kwarg_mbs=[{"attention_masks": block_mask,
               ...}], ...)`` on every rank, for the attention of each stage's layers). torch 2.4's
               ``forward_one_chunk`` calls every stage but the first with no keyword arguments at all:
               torchtitan 0.3's last stage dies with ``AssertionError: attention_masks must be instance
               of BlockMask, got <class 'NoneType'>``; a keyword with a default (``scale=None``,
               ``positions=None``) is silently computed with its default on the later stages.
Torch:         2.4 (the stage sets ``composite_kwargs = {}`` for non-first stages); torch 2.5 is not
               in CI's matrix, so the hook reads the installed torch's ``forward_one_chunk`` and acts
               only where it still drops them (2.9.0 and 2.15.0 pass them, read in their source).
Fix:           as torch >= 2.5: a non-first stage runs its module with the received activations and the
               keyword inputs its schedule handed it for that microbatch, and keeps their tensors with
               the stage's inputs for its backward (``fwd_cache``); the gradients sent back to the
               previous stage are still the activations' only. The first stage, and a step without
               keyword inputs, are torch 2.4's own.
Upstream:      https://github.com/pytorch/pytorch/pull/136416 ("[Pipelining] Allow non-0 stages to
               accept kwargs")
"""

from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

from .._source import torch_source

PATCH = Patch(
    id="pipelining-stage-kwargs",
    summary="schedule.step(**kwargs) / kwarg_mbs reach every pipeline stage's module, not only the first's",
    torch=">=2.4,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/136416",
    behaviour="PipelineStage.forward_one_chunk(mb, args, kwargs) on a non-first stage",
    category="correctness",
)

_DROPS_KWARGS = "composite_kwargs = {}"  # torch 2.4's non-first branch of forward_one_chunk


def _forward_one_chunk(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    chunk = args[0] if args else kwargs["fwd_chunk_id"]
    stage_kwargs = args[2] if len(args) > 2 else kwargs.get("kwargs")
    if instance.is_first or not stage_kwargs:
        return wrapped(*args, **kwargs)
    from torch.distributed.pipelining._utils import flatten_args

    run = instance.forward_maybe_with_nosync

    def with_kwargs(*inputs: Any, **none: Any) -> Any:
        return run(*inputs, **none, **stage_kwargs)

    instance.forward_maybe_with_nosync = with_kwargs
    try:
        output = wrapped(*args, **kwargs)
    finally:
        del instance.forward_maybe_with_nosync
    outputs, inputs = instance.fwd_cache[chunk]
    instance.fwd_cache[chunk] = (outputs, inputs + flatten_args(stage_kwargs))
    return output


@PATCH.on_import("torch.distributed.pipelining.stage")
def pass_kwargs_to_every_stage(patcher: Patcher, stage: Any) -> bool:
    if _DROPS_KWARGS not in torch_source(stage._PipelineStageBase.forward_one_chunk):
        return False
    patcher.wrap(stage._PipelineStageBase, "forward_one_chunk", _forward_one_chunk)
    return True

"""pipelining-stage-init-reshard: a ``PipelineStage`` that sizes its outputs with a forward at
construction leaves its FSDP2 modules sharded, torch 2.4-2.11.

What breaks:   ``PipelineStage(submodule, stage_index, num_stages, device, input_args=...)`` without
               ``output_args`` runs ``submodule(*input_args)`` once at construction to learn its
               output shapes. When ``submodule`` is ``fully_shard``-ed with
               ``reshard_after_forward=False`` (the usual choice under pipeline parallelism), that
               forward leaves it unsharded: the module's registered parameters are then FSDP2's
               unsharded plain tensors, not its sharded DTensors. An optimizer built afterwards
               (``AdamW(stage.submod.parameters())``, the usual order) holds tensors that never get
               a gradient and that FSDP2 drops at the step's reshard: no error, the weights never
               change (measured on 2 ranks, GPipe, AdamW: parameters 0.2 off one-process training
               after two steps, step 2's loss off by 0.014).
Torch:         2.4-2.11 (``PipelineStage.__init__`` runs the submodule when ``input_args`` is given
               and ``output_args`` is not; reproduced on 2.4.1 and 2.9.0, read in 2.11.0's source).
               torch 2.12 (2.12.0's source read; 2.13.0, 2.14.1 and 2.15.0 run right natively) no
               longer runs a forward at construction: it infers the stage's
               metadata at the first step and then reshards every ``FSDPModule`` of the submodule
               (``PipelineStage._post_metadata_inference_cleanup``); the hook checks for that method.
               A stage built without ``input_args`` (torch >= 2.5's runtime shape inference,
               torchpatch's ``pipeline-stage-inference`` on 2.4) runs no forward here and is right.
Fix:           after such a construction, every ``FSDPModule`` in the stage's submodule is
               resharded (``FSDPModule.reshard()``, as torch 2.12+ does after its inference), so the
               registered parameters are the sharded ones again. Other constructions are unchanged.
Upstream:      https://github.com/pytorch/pytorch/pull/177728 ("[PP][2/3] DTensor-aware stage and
               schedule refactoring", torch 2.12: ``_post_metadata_inference_cleanup``)
"""

from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="pipelining-stage-init-reshard",
    summary="PipelineStage(fully_shard(module), ..., input_args=...) without output_args reshards the "
            "module after its construction-time forward (an optimizer built after it gets the sharded parameters)",
    torch=">=2.4,<2.12",
    upstream="https://github.com/pytorch/pytorch/pull/177728",
    behaviour="PipelineStage(fsdp2_module, ..., input_args=...) without output_args",
    category="correctness",
)


def _reshard_after_init(fsdp_module_type: type) -> Any:
    """``PipelineStage.__init__``, then a reshard of the submodule's FSDP2 modules if it ran a forward
    (``input_args`` given, ``output_args`` not: the positional order of torch 2.4-2.11)."""

    def init(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        wrapped(*args, **kwargs)
        input_args = args[4] if len(args) > 4 else kwargs.get("input_args")
        output_args = args[5] if len(args) > 5 else kwargs.get("output_args")
        if input_args is None or output_args is not None:
            return
        for module in instance.submod.modules():
            if isinstance(module, fsdp_module_type):
                module.reshard()

    return init


@PATCH.on_import("torch.distributed.pipelining.stage")
def reshard_after_construction_forward(patcher: Patcher, stage: Any) -> bool:
    if hasattr(stage.PipelineStage, "_post_metadata_inference_cleanup"):
        return False  # torch 2.12+: no forward at construction, a reshard after its inference
    fsdp_module_type = getattr(stage, "FSDPModule", None)
    if fsdp_module_type is None:
        return False  # a stage module that knows no FSDP2: nothing of it to reshard
    patcher.wrap(stage.PipelineStage, "__init__", _reshard_after_init(fsdp_module_type))
    return True

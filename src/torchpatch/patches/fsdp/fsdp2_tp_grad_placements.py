"""fsdp2-tp-grad-placements: FSDP2 + tensor parallelism reduce-scatters a gradient whose DTensor
placement differs from its parameter's as if it had the parameter's, torch 2.4-2.5.

What breaks:   nothing raises. Under FSDP2 over a 2-D (data-parallel x tensor-parallel) mesh, a
               parameter that TP shards (``Shard(0)``) can get a gradient that autograd hands back
               ``Replicate()`` (or ``Partial``): torchtitan's ``tok_embeddings`` under
               ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))`` does, on torch
               2.4. Torch 2.4's FSDP2 (``FSDPParam._get_grad_inner_tensor``) only turns ``Partial``
               into ``Replicate`` and then takes the gradient's local tensor as the TP shard: it
               reduce-scatters the *whole* replicated gradient (the size of all TP ranks' shards
               together) and each rank keeps the first rows of its part. Each (data-parallel,
               tensor-parallel) rank's gradient shard then holds rows of another rank's shard: rows
               of the embedding appear on two ranks and others on none. torchtitan 0.1.0's
               ``fsdp+tp+sac`` (FSDP 2 x TP 2) on 2.4.1 had a first gradient norm 0.14% above
               2.9.0's, all of it the embedding's (its norm sqrt(2) times 2.9.0's); AdamW all but
               hides it in the losses.
Torch:         2.4 (read in 2.4.1's ``_composable/fsdp/_fsdp_param.py``); the fix landed in
               September 2024 (2.5 is outside the matrix: the patch applies there only where its
               source still redistributes just the ``Partial`` placements). 2.9+ redistributes to
               the parameter's TP placements.
Fix:           as upstream: before FSDP2 takes the gradient's local tensor, a DTensor gradient whose
               placements differ from the parameter's TP placements is redistributed to them
               (``Replicate`` -> ``Shard(0)`` is a local slice; ``Partial`` -> ``Shard(0)`` a
               reduce-scatter over the TP group), so its local tensor is this TP rank's shard of
               the gradient. Gradients that already match, and FSDP without TP, are untouched.
Upstream:      https://github.com/pytorch/pytorch/pull/136237 ("[FSDP2] Fixed 2D mismatched grad
               placements")
"""

from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="fsdp2-tp-grad-placements",
    summary="FSDP2 + TP: a gradient placed otherwise than its parameter is redistributed before FSDP reduce-scatters it "
            "(torch < 2.6 reduced another rank's rows)",
    torch=">=2.4,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/136237",
    behaviour="fully_shard over a 2-D mesh with tensor-parallel parameters",
    category="correctness",
)


def _grad_inner_tensor(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed._tensor import DTensor

    grad = args[0] if args else kwargs.pop("grad")
    if instance.is_dtensor:
        if isinstance(grad, AsyncCollectiveTensor):
            grad = grad.wait()
        placements = tuple(instance._tp_spec.placements)
        if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
            if len(grad.placements) != len(placements):
                raise AssertionError(f"FSDP2: gradient placements {grad.placements} do not match the parameter's "
                                     f"tensor-parallel placements {placements}")
            grad = grad.redistribute(placements=placements)
    return wrapped(grad, *args[1:], **kwargs)


@PATCH.on_import("torch.distributed._composable.fsdp._fsdp_param")
def redistribute_to_tp_placements(patcher: Patcher, module: Any) -> bool:
    from torchpatch.patches._source import torch_source

    param = getattr(module, "FSDPParam", None)
    if param is None or not hasattr(param, "_get_grad_inner_tensor"):
        return False  # not the FSDP2 this patch was written for
    if "_tp_spec.placements" in torch_source(param._get_grad_inner_tensor):
        return False  # redistributes to the parameter's placements itself
    patcher.wrap(param, "_get_grad_inner_tensor", _grad_inner_tensor)
    return True

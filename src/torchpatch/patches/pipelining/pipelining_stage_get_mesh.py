"""pipelining-stage-get-mesh: ``PipelineStage(..., get_mesh=callback)``, torch 2.12's keyword for
DTensor activations between stages, on torch 2.4-2.11.

What breaks:   torchtitan 0.3 builds every pipeline stage with
               ``PipelineStage(model_chunk, stage_idx, num_stages, device, group=..., get_mesh=cb)``;
               before torch 2.12 that dies with ``TypeError: PipelineStage.__init__() got an
               unexpected keyword argument 'get_mesh'``.
Torch:         2.4-2.11 (the inventories: ``torch.distributed.pipelining.stage`` has no
               ``GetMeshCallback`` / ``_MeshCache`` before 2.12); 2.12 infers stage metadata at run
               time and rebuilds DTensor activations on the mesh ``get_mesh`` returns.
Fix:           ``get_mesh`` is accepted as a keyword (torchtitan's way; 2.12's positional order
               differs anyway) and kept on the stage as ``_get_mesh``. The callback only matters for
               DTensor activations, which these torch versions' stages cannot send: a stage whose
               outputs for the next stage are DTensors raises a ``NotImplementedError`` that says
               so when its output metadata is fixed (shape inference, before the first send). With
               plain tensors (torchtitan's pipeline-only and FSDP+PP runs) the stage is this torch's.
Upstream:      torch 2.12 (``PipelineStage.__init__``'s ``get_mesh``, ``_MeshCache``);
               https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/stage.py
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="pipelining-stage-get-mesh",
    summary="PipelineStage(..., get_mesh=...) (torch 2.12's callback for DTensor activations) accepted; "
            "DTensor activations between stages raise",
    torch=">=2.4,<2.12",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/stage.py",
    behaviour="PipelineStage(..., get_mesh=callback)",
    errors=(
        Error(r"unexpected keyword argument 'get_mesh'",
              "TypeError: PipelineStage.__init__() got an unexpected keyword argument 'get_mesh'"),
    ),
)
PATCH.takes("torch.distributed.pipelining.stage.PipelineStage", ("get_mesh=None",))  # for ``torchpatch check``


def _init(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    get_mesh = kwargs.pop("get_mesh", None)
    result = wrapped(*args, **kwargs)
    instance._get_mesh = get_mesh
    return result


def _configure_outputs_meta(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A stage's output metadata, fixed before its first send: DTensor activations raise here."""
    if not instance.is_last:
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_leaves

        if any(isinstance(leaf, DTensor) for leaf in tree_leaves(list(args) + list(kwargs.values()))):
            raise NotImplementedError(
                f"pipeline stage {instance.stage_index} outputs a DTensor: sending DTensor activations between "
                "stages needs torch 2.12's DTensor-aware stage metadata (PipelineStage's get_mesh), which "
                "torchpatch does not serve on this torch; hand plain tensors (DTensor.to_local()) between stages")
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.distributed.pipelining.stage")
def _patch(patcher: Patcher, module: ModuleType) -> bool:
    stage = module.PipelineStage
    if "get_mesh" in inspect.signature(stage.__init__).parameters:
        return False
    patcher.wrap(stage, "__init__", _init)
    patcher.wrap(module._PipelineStageBase, "_configure_outputs_meta", _configure_outputs_meta)
    return True

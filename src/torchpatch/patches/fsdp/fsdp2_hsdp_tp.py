"""fsdp2-hsdp-tp: HSDP + tensor parallelism with FSDP2 (``fully_shard`` over a (replicate, shard) mesh of
TP'd parameters), torch 2.4.

What breaks:   ``fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])`` on a model whose parameters
               tensor parallelism made DTensors on ``mesh["tp"]`` raises ``NotImplementedError: Using TP
               with HSDP is not supported`` (2.4.1's ``FSDPParam._init_sharded_param``,
               ``_composable/fsdp/_fsdp_param.py``): torchtitan's ``data_parallel_replicate_degree`` > 1
               with ``tensor_parallel_degree`` > 1 cannot start.
Torch:         2.4 (read in 2.4.1); 2.5 has HSDP + TP (pytorch#133335, August 2024, before 2.5's branch
               cut): the parameter labelled ``(Replicate(), Shard(0) or _StridedShard(0), tp)`` on the
               3-D (replicate, shard, tp) mesh, as 2.9.0's ``_fully_shard/_fsdp_param.py`` still does.
Fix:           the data FSDP2 keeps and its collectives do not depend on the replicate dim: each rank
               holds its shard-dim rank's chunk (``torch.chunk`` on dim 0) of its TP shard, all-gathers
               over the shard group, reduce-scatters gradients over the shard group and then all-reduces
               them over the replicate group (2.4's ``foreach_reduce`` already does both for HSDP, dividing
               by shard x replicate size). So torch's own FSDP + TP initialisation is run with the mesh
               info of the HSDP mesh's shard dim (the same group, rank and size), then the mesh info is
               put back and the sharded parameter is labelled with what it stores, as
               fsdp2-2d-state-dict labels FSDP + TP: ``(<TP placement>, Replicate(), Shard(0))`` on the
               (tp, replicate, shard) mesh (the 3-D mesh's ranks and process groups, dims reordered:
               TP's shard first, then FSDP's chunk of it, which 2.4 cannot say on the (replicate, shard,
               tp) mesh without 2.5's ``_StridedShard``). ``full_tensor()``, redistribution, the
               gradients, the optimizer states made like the parameters and DCP's offsets follow the
               label; fsdp2-2d-state-dict (required) then removes the state dict refusal. What differs
               from torch >= 2.5: such a parameter's ``device_mesh`` is the (tp, replicate, shard) mesh
               (``_spmd_mesh`` and ``_spmd_placements`` are 2.5's). Still refused, by torch: 2-D TP,
               ``reshard_after_forward`` as an int with TP, DP and TP meshes of different parents.
Upstream:      https://github.com/pytorch/pytorch/pull/133335 ("[FSDP2] Enable HSDP + TP")
"""

from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-hsdp-tp",
    summary="FSDP2 HSDP + TP on torch 2.4: fully_shard over a (replicate, shard) mesh of tensor-parallel parameters",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/133335",
    requires=("fsdp2-2d-state-dict",),  # the state dict refusal's removal and the relabelling helpers
    behaviour="fully_shard over a 2-D (replicate, shard) mesh with tensor-parallel (DTensor) parameters",
    errors=(
        Error(r'Using TP with HSDP is not supported',
              "NotImplementedError: Using TP with HSDP is not supported"),
    ),
)

_REFUSAL = "Using TP with HSDP is not supported"


def _shard_mesh_info(mesh_info: Any) -> Any:
    """FSDP (not HSDP) mesh info of the HSDP mesh's shard dim, sliced from the root mesh so that
    torch's check that the DP and TP meshes share a parent holds as it does for the HSDP mesh."""
    from torch.distributed._composable.fsdp._fsdp_common import FSDPMeshInfo
    from torch.distributed._tensor.device_mesh import _mesh_resources

    mesh = mesh_info.mesh
    if mesh.mesh_dim_names is None:
        raise AssertionError("FSDP requires named DeviceMesh dims for ND parallelism (HSDP + TP)")
    root = _mesh_resources.get_parent_mesh(mesh)
    root = mesh if root is None else root  # then torch's parent check refuses: TP's mesh is not this one's
    info = FSDPMeshInfo(root[mesh.mesh_dim_names[mesh_info.shard_mesh_dim]], shard_mesh_dim=0)
    if (info.shard_mesh_rank, info.shard_mesh_size) != (mesh_info.shard_mesh_rank, mesh_info.shard_mesh_size):
        raise AssertionError(f"HSDP + TP: the shard dim sliced from the root mesh ({info.shard_mesh_rank} of "
                             f"{info.shard_mesh_size}) is not the HSDP mesh's ({mesh_info.shard_mesh_rank} of "
                             f"{mesh_info.shard_mesh_size})")
    return info


def _init_sharded_param(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    from torch.distributed._tensor import DTensor, Replicate, Shard
    from torch.distributed._tensor.device_mesh import _mesh_resources

    from torchpatch.patches.fsdp.fsdp2_2d_state_dict import permuted, relabel

    param = args[0] if args else kwargs["param"]
    mesh_info = instance.mesh_info
    if not (isinstance(param, DTensor) and mesh_info.replicate_mesh_dim == 0 and mesh_info.shard_mesh_dim == 1):
        return wrapped(*args, **kwargs)  # FSDP (+ TP), or HSDP without TP: torch's own
    instance.mesh_info = _shard_mesh_info(mesh_info)
    try:
        result = wrapped(*args, **kwargs)  # torch's FSDP + TP on the shard dim: the data HSDP holds
    finally:
        instance.mesh_info = mesh_info
    tp_mesh = instance._tp_spec.mesh
    root = _mesh_resources.get_parent_mesh(mesh_info.mesh)
    names = mesh_info.mesh.mesh_dim_names + tp_mesh.mesh_dim_names
    spmd_mesh = root if tuple(root.mesh_dim_names) == names else root[names]
    (tp_placement,) = instance._tp_spec.placements  # torch refused 2-D TP already
    instance._spmd_mesh = spmd_mesh
    instance._spmd_placements = (Replicate(), Shard(0), tp_placement)
    relabel(instance, permuted(spmd_mesh, (2, 0, 1)), (tp_placement, Replicate(), Shard(0)))
    return result


@PATCH.on_import("torch.distributed._composable.fsdp._fsdp_param")
def hsdp_with_tp(patcher: Patcher, module: Any) -> bool:
    from torchpatch.patches._source import torch_source

    param = getattr(module, "FSDPParam", None)
    if param is None or _REFUSAL not in torch_source(param._init_sharded_param):
        return False  # a torch with HSDP + TP (or another FSDP2 than the one read)
    patcher.wrap(param, "_init_sharded_param", _init_sharded_param)
    return True

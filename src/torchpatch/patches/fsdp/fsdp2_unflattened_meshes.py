"""fsdp2-unflattened-meshes: FSDP2 + TP where the DP and TP meshes are sliced from two unflattenings of
one mesh, torch 2.4.

What breaks:   torchtitan 0.2.2 unflattens its world mesh several times (``("pp", "batch", "cp", "tp")``
               for data loading, ``("pp", "dp_replicate", "fsdp", "tp")`` for the dense layers) and
               shards with FSDP over ``dense["fsdp"]`` the parameters tensor parallelism made DTensors
               on ``dataloading["tp"]``. On torch 2.4 (with device-mesh-unflatten) each unflattened mesh
               is a parent of its own, and every ``fsdp+tp`` run stops in ``fully_shard`` with
               ``AssertionError: FSDP requires the DP and TP mesh to have the same parent mesh``
               (2.4.1's ``FSDPParam._init_sharded_param``).
Torch:         2.10+ keeps one root for every mesh unflattened from a mesh (its layouts), and FSDP2
               concatenates the DP and TP meshes (``DeviceMesh._concatenate``: the same root, dims that
               do not overlap, each dim's own process group); 2.4 asks both meshes' parent for
               ``parent[dp_names + tp_names]``.
Fix:           while FSDP2 builds such a parameter (``FSDPParam.__init__``), where the DP and TP
               meshes' parents are two unflattenings of one mesh (device-mesh-unflatten's records),
               both meshes' parent is taken to be the first of those unflattenings that has the DP and
               TP dims and whose slices of them hold the DP and TP meshes' ranks on this rank (for
               torchtitan: the dense mesh, whose ``("fsdp", "tp")`` slice is 2.15's concatenation: the
               same ranks, a TP group over the same ranks). Anything else, meshes of unrelated parents
               included, meets 2.4's check as before. Outside that call ``get_parent_mesh`` is 2.4's
               (tensor parallelism's check that TP is its parent's last dim keeps reading its own mesh).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/fsdp/_fully_shard/_fsdp_param.py
               (``_init_sharding_spec_tp``: ``DeviceMesh._concatenate([dp_mesh, tp_mesh])``)
"""

import threading
from types import ModuleType
from typing import Any, Dict, Optional, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-unflattened-meshes",
    summary="FSDP2 + TP on torch 2.4 with the DP and TP meshes sliced from two unflattenings of one mesh "
            "(torchtitan 0.2.2's dense and data-loading meshes)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/fsdp/_fully_shard/_fsdp_param.py",
    requires=("device-mesh-unflatten",),
    behaviour="fully_shard of tensor-parallel parameters, DP and TP meshes from two DeviceMesh._unflatten calls",
    errors=(
        Error(r"FSDP requires the DP and TP mesh to have the same parent mesh",
              "AssertionError: FSDP requires the DP and TP mesh to have the same parent mesh but got: ..."),
    ),
)
FSDP_PARAM = "torch.distributed._composable.fsdp._fsdp_param"

_building = threading.local()  # .parents: {id(mesh): parent} while an FSDPParam of such meshes is built
_COMMON: Dict[Tuple[int, int], Tuple[Any, Any, Optional[Any]]] = {}  # (id dp, id tp) -> (dp, tp, parent)


def _common_parent(dp: Any, tp: Any) -> Optional[Any]:
    """The unflattening of the DP and TP meshes' common origin that holds both, else None."""
    import torch
    from torch.distributed.device_mesh import _mesh_resources

    from torchpatch.patches.device_mesh.device_mesh_unflatten import unflattened_alongside

    parent_dp, parent_tp = _mesh_resources.get_parent_mesh(dp), _mesh_resources.get_parent_mesh(tp)
    if parent_dp is None or parent_tp is None or parent_dp is parent_tp or not dp.mesh_dim_names \
            or not tp.mesh_dim_names:
        return None
    siblings = unflattened_alongside(parent_dp)
    if not any(parent_tp is mesh for mesh in siblings):
        return None
    for mesh in siblings:
        if not set(dp.mesh_dim_names + tp.mesh_dim_names) <= set(mesh.mesh_dim_names or ()):
            continue
        try:
            dp_slice, tp_slice = mesh[dp.mesh_dim_names], mesh[tp.mesh_dim_names]
        except KeyError:  # 2.4 slices contiguous dims only
            continue
        if torch.equal(dp_slice.mesh, dp.mesh) and torch.equal(tp_slice.mesh, tp.mesh):
            return mesh
    return None


def _get_parent_mesh(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    parents = getattr(_building, "parents", None)
    if parents:
        mesh = args[0] if args else kwargs["device_mesh"]
        if id(mesh) in parents:
            return parents[id(mesh)]
    return wrapped(*args, **kwargs)


def _fsdp_param_init(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    from torch.distributed._tensor import DTensor

    param = args[0] if args else kwargs["param"]
    mesh_info = args[2] if len(args) > 2 else kwargs["mesh_info"]
    if not isinstance(param, DTensor) or mesh_info.mesh.ndim != 1:
        return wrapped(*args, **kwargs)
    dp, tp = mesh_info.mesh, param.device_mesh
    entry = _COMMON.get((id(dp), id(tp)))
    if entry is None or entry[0] is not dp or entry[1] is not tp:
        entry = _COMMON[(id(dp), id(tp))] = (dp, tp, _common_parent(dp, tp))  # keeps both alive: ids stay theirs
    if entry[2] is None:
        return wrapped(*args, **kwargs)
    previous = getattr(_building, "parents", None)
    _building.parents = {id(dp): entry[2], id(tp): entry[2]}
    try:
        return wrapped(*args, **kwargs)
    finally:
        _building.parents = previous


@PATCH.on_import(FSDP_PARAM)
def common_parent(patcher: Patcher, module: ModuleType) -> bool:
    from torch.distributed import device_mesh

    from torchpatch.patches._source import torch_source

    param = getattr(module, "FSDPParam", None)
    if param is None or "get_parent_mesh(tp_mesh)" not in torch_source(param._init_sharded_param):
        return False  # a torch whose FSDP2 does not ask the meshes' parent (2.5+: their root)
    patcher.wrap(type(device_mesh._mesh_resources), "get_parent_mesh", _get_parent_mesh)
    patcher.wrap(param, "__init__", _fsdp_param_init)
    patcher.on_undo(_COMMON.clear)
    return True

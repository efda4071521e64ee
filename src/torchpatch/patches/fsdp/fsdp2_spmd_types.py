"""fsdp2-spmd-types: ``fully_shard(dp_mesh_dims=...)`` takes plain parameters annotated by the
spmd_types package, torch 2.12-2.13.

What breaks:   code written for torch 2.14 that annotates plain parameters with spmd_types
               (``spmd.assert_type(param, {"dp_shard": spmd.R, ...})``) and hands them to
               ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` (torchtitan
               0.3.0's default ``spmd_backend="spmd_types"``: FSDP, TP, FSDP+TP, DCP) stops at
               ``ValueError: When dp_mesh_dims is provided, all parameters must be DTensors on the full
               SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter 'weight'.``
Torch:         2.14 (read in 2.14.1's and 2.15.0's ``fsdp/_fully_shard/_fsdp_param.py``: the same code)
               translates each annotated plain parameter into a DTensor on the storage mesh before
               sharding, keeps the unsharded parameter plain for module compute and wraps its plain
               gradient as a DTensor with the annotation's backward placements. 2.13.0's FSDP2 has
               ``dp_mesh_dims`` and the DTensor path (``_init_sharding_spec_spmd``) but refuses plain
               parameters; 2.12.1's has the same methods (read in its inventory only).
Fix:           2.14's handling, with its semantics and errors: where ``dp_mesh_dims`` is given,
               spmd_types is installed and a plain parameter carries an spmd_types local type, the
               parameter is resolved as 2.14 does (FSDP axes must be ``spmd.R``; non-FSDP storage axes
               must be annotated; partial annotations are completed from ``spmd.current_mesh()``;
               2.14's ``ValueError``s otherwise) into a DTensor on the storage mesh, which 2.13's DTensor
               path then shards. Its unsharded parameter stays a plain tensor and its gradient is wrapped
               as a DTensor with the backward placements (``R`` -> ``Partial``, ``S(d)`` -> ``Shard(d)``,
               ``I`` -> ``Replicate``), so FSDP reduces it as 2.14 does. Without ``dp_mesh_dims`` nothing
               runs but one attribute check per parameter at ``fully_shard`` time (2.14 would also reject
               annotated parameters there; 2.13 keeps sharding them as plain tensors); the runtime
               wrappers are installed at the first annotated parameter. Not served: 2.14's spmd type
               checking inside FSDP (``no_typecheck`` around its collectives, annotations restored on
               the unsharded parameters): torchtitan's ``spmd_typechecking`` is off by default.
Upstream:      https://github.com/pytorch/pytorch/pull/187394
"""

import importlib
import importlib.util
import itertools
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-spmd-types",
    summary="fully_shard(dp_mesh_dims=...) takes plain parameters annotated by spmd_types (torch 2.14's "
    "translation to DTensor storage; torchtitan 0.3.0's default SPMD backend)",
    torch=">=2.12,<2.14",
    upstream="https://github.com/pytorch/pytorch/pull/187394",
    behaviour="fully_shard(dp_mesh_dims=...) on spmd_types-annotated plain parameters",
    errors=(
        Error(r'When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh',
              "ValueError: When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh (e.g. via distribute_module). Got plain tensor for parameter 'weight'."),
    ),
)


def _spans_same_mesh(spmd: ModuleType, lhs_axes: Tuple[Any, ...], rhs_axes: Tuple[Any, ...]) -> bool:
    """Whether two axis sets span the same normalized rank mesh (2.14's ``_spans_same_mesh``)."""
    from spmd_types._mesh_axis import flatten_axes

    lhs_mesh = spmd.normalize_mesh(frozenset(lhs_axes))
    rhs_mesh = spmd.normalize_mesh(frozenset(rhs_axes))
    if not lhs_mesh or not rhs_mesh:
        return lhs_mesh == rhs_mesh
    return flatten_axes(tuple(lhs_mesh)) == flatten_axes(tuple(rhs_mesh))


def _storage_dtensor(spmd: ModuleType, fsdp_param: Any, param: Any, init_local_type: Dict[Any, Any]) -> Any:
    """The DTensor on the storage mesh that 2.14 makes of an annotated plain parameter; sets
    ``_spmd_grad_placements`` (the gradient's placements) on ``fsdp_param``. Raises 2.14's errors."""
    import torch.nn as nn
    from spmd_types._mesh_axis import flatten_axes
    from spmd_types.runtime import get_partition_spec
    from spmd_types.types import partition_spec_to_shard_types
    from torch.distributed.tensor import DTensor

    name = fsdp_param._module_info.param_name
    mesh_info = fsdp_param.mesh_info
    storage_mesh = mesh_info.spmd_mesh
    if storage_mesh is None or storage_mesh.mesh_dim_names is None:
        raise ValueError(
            "spmd_types parameters require fully_shard() to be called with both a named full DeviceMesh for "
            "FSDP storage and dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...), where shard names "
            "the mesh axis or axes FSDP shards parameters across and replicate names the HSDP/DDP mesh axis or "
            "axes FSDP replicates across.")
    storage_mesh_axes = [(dim, spmd.MeshAxis.of(storage_mesh.get_group(dim))) for dim in storage_mesh.mesh_dim_names]
    storage_axes = tuple(axis for _, axis in storage_mesh_axes)
    local_type = dict(init_local_type)
    partition_spec = get_partition_spec(param)
    if partition_spec is not None:
        local_type.update(partition_spec_to_shard_types(partition_spec))
    annotated_axes = tuple(local_type)

    current_mesh = spmd.current_mesh()
    if _spans_same_mesh(spmd, annotated_axes, storage_axes):
        restore_mesh = annotated_axes
    elif current_mesh is not None:
        restore_mesh = tuple(current_mesh)
    else:
        raise ValueError(
            f"Parameter '{name}' has partial spmd_types annotations that cannot be restored from its FSDP storage "
            "mesh. Fully annotate the parameter on its storage mesh, or wrap fully_shard() in "
            "spmd.set_current_mesh(...) when all parameters in the FSDP unit share one typechecking mesh. Mixed "
            "per-parameter typechecking meshes with partial annotations are not supported. "
            f"Annotated axes: {annotated_axes}. Storage mesh axes: {storage_axes}.")
    unknown_axes = tuple(axis for axis in init_local_type if axis not in restore_mesh)
    if unknown_axes:
        raise ValueError(
            f"FSDP found spmd_types annotations on parameter '{name}' and will restore runtime annotations on "
            f"compute mesh axes {restore_mesh}, but the parameter is annotated on axes {unknown_axes} that are not "
            "in that mesh. Annotate only axes in the compute mesh.")
    if not _spans_same_mesh(spmd, restore_mesh, storage_axes):
        raise ValueError(
            f"Parameter '{name}' uses spmd_types annotations on a typechecking mesh that does not span the same "
            "ranks as its FSDP storage mesh. FSDP can fill omitted FSDP-managed axes only when these meshes span "
            f"the same rank set. Typechecking mesh axes: {restore_mesh}. Storage mesh axes: {storage_axes}.")
    dp_names = set(itertools.chain(mesh_info.dp_mesh_dims.shard_names, mesh_info.dp_mesh_dims.replicate_names))
    fsdp_axis = flatten_axes(tuple(axis for dim, axis in storage_mesh_axes if dim in dp_names))
    non_fsdp_axes = {axis for dim, axis in storage_mesh_axes if dim not in dp_names}
    storage_axis_types = {axis: spmd.R for dim, axis in storage_mesh_axes if dim in dp_names}
    for axis, axis_type in local_type.items():
        if axis <= fsdp_axis:  # MeshAxis ordering: contained in the FSDP submesh
            if axis_type is not spmd.R:
                raise ValueError(
                    f"Expected spmd.R on FSDP DP axis {axis} for parameter '{name}' but got {axis_type}. FSDP "
                    "requires DP parameters to be R since it handles the DP gradient reduction.")
        else:
            if axis not in non_fsdp_axes:
                raise ValueError(
                    f"Parameter '{name}' has spmd_types annotation on axis {axis}, which is neither a non-FSDP "
                    "storage-mesh axis nor contained in the FSDP DP mesh.")
            storage_axis_types[axis] = axis_type
    if set(storage_axes) != set(storage_axis_types):
        missing = tuple(axis for _, axis in storage_mesh_axes if axis not in storage_axis_types)
        raise ValueError(
            f"Parameter '{name}' has incomplete spmd_types annotations for FSDP storage. "
            f"Annotated axes: {tuple(local_type)}. Storage mesh axes: {storage_axes}. "
            f"FSDP mesh dims: {mesh_info.dp_mesh_dims}. Missing non-FSDP storage axes: {missing}.")
    placements: List[Any] = []
    grad_placements: List[Any] = []
    for axis_type in storage_axis_types.values():
        placements.append(spmd.spmd_type_to_dtensor_placement(axis_type))
        grad_placements.append(spmd.spmd_type_to_dtensor_placement(axis_type.backward_type()))
    dtensor_param = nn.Parameter(
        DTensor.from_local(param.data, storage_mesh, placements, run_check=False), requires_grad=param.requires_grad)
    fsdp_param._spmd_grad_placements = tuple(grad_placements)
    return dtensor_param


def _init_unsharded_param(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """2.14 keeps an annotated parameter's unsharded parameter a plain tensor."""
    if not getattr(instance, "is_spmd_types", False):
        return wrapped(*args, **kwargs)
    spec, instance._unsharded_dtensor_spec = instance._unsharded_dtensor_spec, None
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance._unsharded_dtensor_spec = spec


def _get_grad_inner_tensor(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """2.14 wraps an annotated parameter's plain gradient as a DTensor with the backward placements."""
    if getattr(instance, "is_spmd_types", False):
        from torch.distributed.tensor import DTensor

        grad = args[0] if args else kwargs.pop("grad")
        grad = DTensor.from_local(
            grad, instance._unsharded_dtensor_spec.mesh, instance._spmd_grad_placements, run_check=False)
        args = (grad,) + tuple(args[1:])
    return wrapped(*args, **kwargs)


def _patch_fsdp_param(patcher: Patcher, param_module: ModuleType) -> bool:
    fsdp_param_type = param_module.FSDPParam
    if hasattr(fsdp_param_type, "_resolve_spmd_types_for_storage") or not hasattr(
            fsdp_param_type, "_init_sharding_spec_spmd"):
        return False  # torch >= 2.14 translates itself; before 2.12 FSDP2 has no dp_mesh_dims
    runtime: List[bool] = []

    def init_sharding_spec(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        mesh_info = instance.mesh_info
        if not getattr(mesh_info, "is_spmd_mesh", False) or instance.is_dtensor:
            return wrapped(*args, **kwargs)
        spmd = _spmd_types()
        param = args[0] if args else kwargs.pop("param")
        init_local_type = spmd.get_local_type(param) if spmd is not None else None
        if not init_local_type:
            return wrapped(*args, **kwargs)
        param = _storage_dtensor(spmd, instance, param, init_local_type)
        instance.is_spmd_types = instance.is_dtensor = True
        if hasattr(param_module, "_get_orig_param_uid"):  # 2.13+: as 2.14, the DTensor parameter's uid
            instance._orig_param_uid = param_module._get_orig_param_uid(param)
        if not runtime:
            patcher.wrap(fsdp_param_type, "init_unsharded_param", _init_unsharded_param)
            patcher.wrap(fsdp_param_type, "_get_grad_inner_tensor", _get_grad_inner_tensor)
            runtime.append(True)
        return wrapped(param, *args[1:], **kwargs)

    patcher.wrap(fsdp_param_type, "_init_sharding_spec", init_sharding_spec)
    return True


def _spmd_types() -> Optional[ModuleType]:
    """The spmd_types package where installed (2.14 looks with ``find_spec`` too)."""
    if importlib.util.find_spec("spmd_types") is None:
        return None
    return importlib.import_module("spmd_types")


PATCH.on_import("torch.distributed.fsdp._fully_shard._fsdp_param")(_patch_fsdp_param)

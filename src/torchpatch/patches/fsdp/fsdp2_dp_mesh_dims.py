"""fsdp2-dp-mesh-dims: ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``
where only the data-parallel dims of the full mesh have more than one rank, torch 2.9-2.11.

What breaks:   torchtitan 0.3 (its default ``spmd_backend="spmd_types"``) shards with
               ``fully_shard(block, mesh=storage_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``
               whenever its storage mesh has more than one rank; before torch 2.12 every FSDP run
               stops at ``TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'``.
Torch:         2.12 added the argument (FSDP2 over a full SPMD mesh: parameters that are DTensors on
               the full mesh, or, from 2.14, plain parameters annotated by spmd_types); 2.9-2.11's
               ``fully_shard`` takes the data-parallel mesh itself.
Fix:           where every other dim of the full mesh has one rank and no parameter is a DTensor
               (torchtitan's FSDP and FSDP+PP runs: plain parameters annotated by spmd_types, ``tp``/
               ``cp``/``ep`` of size one), sharding over the full mesh is sharding over its
               data-parallel dims: this torch's ``fully_shard`` runs on ``mesh[shard]`` (several
               shard dims flattened into one; ``(replicate, shard)`` for HSDP), as torch 2.15 shards
               and reduces over those dims. A plain parameter raises 2.15's ``ValueError`` unless it carries spmd_types
               annotations that 2.14's translation accepts (fsdp2-spmd-types' resolution: complete
               on the full mesh, ``spmd.R`` on the data-parallel axes). The sharded
               parameters are DTensors on the data-parallel mesh, not on the full mesh (the other
               dims have one rank: the same shards, one placement per data-parallel dim). Otherwise (a tensor-parallel dim of several ranks, DTensor parameters on the full
               mesh) it raises ``NotImplementedError``: FSDP2's SPMD-mesh parameter path
               (``FSDPParam._init_sharding_spec_spmd``, ``_StridedShard`` over dims that share a
               tensor dim) is not served (not_backportable.json). Without ``dp_mesh_dims``,
               ``fully_shard`` is this torch's.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.12.1/torch/distributed/fsdp/_fully_shard/_fully_shard.py
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="fsdp2-dp-mesh-dims",
    summary="fully_shard(mesh=full_mesh, dp_mesh_dims=...) where only the data-parallel dims have several "
            "ranks: sharded over those dims",
    torch=">=2.9,<2.12",
    upstream="https://github.com/pytorch/pytorch/tree/v2.12.1/torch/distributed/fsdp/_fully_shard/_fully_shard.py",
    behaviour="fully_shard(dp_mesh_dims=...)",
    requires=("fsdp-data-parallel-mesh-dims",),
)

# where torchtitan and torch's own modules take fully_shard from
HOMES = ("torch.distributed.fsdp._fully_shard._fully_shard", "torch.distributed.fsdp._fully_shard",
         "torch.distributed.fsdp", "torch.distributed._composable.fsdp",
         "torch.distributed._composable.fsdp.fully_shard")


def _names(names: Any) -> Tuple[str, ...]:
    if names is None:
        return ()
    return (names,) if isinstance(names, str) else tuple(names)


def _unserved(why: str) -> NotImplementedError:
    import torch

    return NotImplementedError(
        f"fully_shard(dp_mesh_dims=...) {why}: FSDP2 over a full SPMD mesh (torch 2.12's "
        f"FSDPParam._init_sharding_spec_spmd) is not served on torch {torch.__version__}; torchpatch shards "
        "over the data-parallel dims only where every other mesh dim has one rank and parameters are plain tensors")


def _dp_mesh(module: Any, mesh: Any, dp_mesh_dims: Any, ignored: Any) -> Any:
    """The data-parallel mesh that sharding over ``dp_mesh_dims`` of the full ``mesh`` amounts to."""
    from torch.distributed.tensor import DTensor

    names = mesh.mesh_dim_names if mesh is not None else None
    if not names:
        raise ValueError("fully_shard(dp_mesh_dims=...) needs a mesh with mesh_dim_names (the full SPMD mesh)")
    shard, replicate = _names(dp_mesh_dims.shard), _names(dp_mesh_dims.replicate)
    missing = [name for name in shard + replicate if name not in names]
    if missing:
        raise ValueError(f"dp_mesh_dims names {missing} not in the mesh's dims {list(names)}")
    others = [name for name in names if name not in shard + replicate and mesh[name].size() > 1]
    if others:
        raise _unserved(f"with mesh dims {others} of several ranks beside the data-parallel ones")
    if len(replicate) > 1 or (replicate and len(shard) != 1):
        raise _unserved("with several replicate dims, or HSDP over several shard dims")
    if not shard:
        raise _unserved("with replicate dims only (DDP over the full mesh)")
    if replicate:
        dp_mesh = mesh[replicate + shard]
    else:
        dp_mesh = mesh[shard] if len(shard) == 1 else mesh[shard]._flatten()
    modules = module if isinstance(module, (list, tuple)) else [module]
    for m in modules:
        for name, param in m.named_parameters():
            if isinstance(param, DTensor):  # a submodule's, sharded by an earlier fully_shard: on dp_mesh
                if param.device_mesh != dp_mesh:
                    raise _unserved("with DTensor parameters (on the full mesh or another one)")
            elif param not in ignored:
                _check_annotation(name.rsplit(".", 1)[-1], param, mesh, dp_mesh_dims)
    return dp_mesh


def _check_annotation(name: str, param: Any, mesh: Any, dp_mesh_dims: Any) -> None:
    """torch 2.15's demands on a plain parameter (its ``ValueError``s): spmd_types annotations that
    complete on the full mesh, ``spmd.R`` on the data-parallel axes (fsdp2-spmd-types' resolution)."""
    import importlib.util
    from types import SimpleNamespace

    from .fsdp2_spmd_types import _storage_dtensor

    spmd = importlib.import_module("spmd_types") if importlib.util.find_spec("spmd_types") else None
    local_type = spmd.get_local_type(param) if spmd is not None else None
    if not local_type:
        raise ValueError("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh "
                         f"(e.g. via distribute_module). Got plain tensor for parameter '{name}'.")
    fsdp_param = SimpleNamespace(_module_info=SimpleNamespace(param_name=name),
                                 mesh_info=SimpleNamespace(spmd_mesh=mesh, dp_mesh_dims=dp_mesh_dims))
    _storage_dtensor(spmd, fsdp_param, param, local_type)


def _with_dp_mesh_dims(fully_shard: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fully_shard)
    def wrapper(module: Any, *args: Any, dp_mesh_dims: Any = None, **kwargs: Any) -> Any:
        if dp_mesh_dims is not None:
            kwargs["mesh"] = _dp_mesh(module, kwargs.get("mesh"), dp_mesh_dims, kwargs.get("ignored_params") or ())
        return fully_shard(module, *args, **kwargs)

    wrapper.__torchpatch_wraps__ = fully_shard  # type: ignore[attr-defined]
    return wrapper


def _patch_home(patcher: Patcher, home: ModuleType) -> bool:
    import inspect

    original = getattr(home, "fully_shard", None)
    if not callable(original) or isinstance(original, ModuleType) or hasattr(original, "__torchpatch_wraps__"):
        return False
    if "dp_mesh_dims" in inspect.signature(original).parameters:
        return False  # torch >= 2.12
    patcher.setattr(home, "fully_shard", _with_dp_mesh_dims(original))
    return True


for _home in HOMES:
    PATCH.on_import(_home)(_patch_home)

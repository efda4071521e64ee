"""fsdp2-dp-mesh-dims: ``fully_shard(module, mesh=full_mesh, dp_mesh_dims=DataParallelMeshDims(...))``
(FSDP2 over a full SPMD mesh: FSDP, HSDP, TP), torch 2.4-2.11.

What breaks:   torchtitan 0.3 (its default ``spmd_backend="spmd_types"``) shards with
               ``fully_shard(block, mesh=storage_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``
               whenever its storage mesh has more than one rank; before torch 2.12 every FSDP, TP and
               FSDP+TP run stops at ``TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'``.
Torch:         2.12 added the argument (parameters that are DTensors on the full mesh; from 2.14 plain
               parameters annotated by spmd_types too); 2.9-2.11's ``fully_shard`` takes the
               data-parallel mesh itself, and TP parameters as DTensors on a TP mesh of the same root.
Fix:           this torch's ``fully_shard`` runs on the data-parallel sub-mesh ``mesh[shard]`` (several
               shard dims flattened into one; ``(replicate, shard)`` for HSDP). Where every other dim has
               one rank and parameters are plain, nothing else changes (the shards are 2.15's; the
               sharded parameters are DTensors on the data-parallel mesh). Otherwise (a TP dim of several
               ranks) each spmd_types-annotated parameter first becomes a DTensor on
               the sub-mesh of the non-data-parallel dims with its full-mesh placements there (an
               spmd_types-annotated one resolved as 2.14 does: fsdp2-spmd-types' resolution and
               ``ValueError``s), which is this torch's native FSDP+TP / HSDP+TP input: the sharded
               parameters are DTensors on ``root[dp dims + other dims]`` (the full mesh where it is one
               mesh) with 2.15's placements (``_StridedShard`` on the dp dim where TP shards the same
               tensor dim). As 2.15: the unsharded parameter stays plain; the gradient (plain, with the
               annotation's backward placements) is reduced over the TP dims to the parameter's placements there and by
               FSDP over the data-parallel ones. Not served (``NotImplementedError``): several replicate
               dims, replicate only, HSDP over several shard dims, a non-data-parallel dim before a
               data-parallel one, more than two non-data-parallel dims of several ranks (this FSDP2 takes
               1-D TP/EP or 2-D EP+TP), DTensor parameters on the full mesh (torchtitan's
               ``full_dtensor`` backend: measured with 2.13's losses and placements but not its
               gradients, so refused), and data-parallel dims of several ranks beside a TP dim of
               several ranks (FSDP+TP, HSDP+TP) where dtensor-strided-shard-pointwise is off (this
               torch's ``copy_`` into a ``_StridedShard`` parameter from a replicated value, as
               torchtitan 0.3.0 loads its fused wqkv, puts other ranks' rows there: its fsdp+tp+sac
               on 2.9.0 started from other weights and trained 6.5e-3 off one process in 8 steps,
               1.9e-3 in 3; with that patch its start weights equal 2.15.0's, 1.1e-7 in 3 steps);
               ``reshard_after_forward=<int>`` with TP stays this torch's ``NotImplementedError``; the
               ``full_tensor()`` of a parameter whose dim does not divide by dp x tp is
               dtensor-strided-shard-uneven's ``NotImplementedError`` (this torch gathers it out of order).
               Without ``dp_mesh_dims``, ``fully_shard`` is this torch's. On 2.4 (FSDP2 under
               ``torch.distributed._composable.fsdp``) the same, with 2.4's own FSDP+TP labelling
               (fsdp2-2d-state-dict: no ``_StridedShard``, so the ``copy_`` refusal above does not
               apply); measured there: torchtitan 0.3.0's ``fsdp`` (docs/torchtitan.md).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.12.1/torch/distributed/fsdp/_fully_shard/_fully_shard.py
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-dp-mesh-dims",
    summary="fully_shard(mesh=full_mesh, dp_mesh_dims=...): FSDP/HSDP (+TP) over a full SPMD mesh, as this "
            "torch's FSDP2 over the data-parallel sub-mesh with TP DTensor parameters",
    torch=">=2.4,<2.12",
    upstream="https://github.com/pytorch/pytorch/tree/v2.12.1/torch/distributed/fsdp/_fully_shard/_fully_shard.py",
    behaviour="fully_shard(dp_mesh_dims=...)",
    requires=("fsdp-data-parallel-mesh-dims",),
    errors=(
        Error(r"unexpected keyword argument 'dp_mesh_dims'",
              "TypeError: fully_shard() got an unexpected keyword argument 'dp_mesh_dims'"),
    ),
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
        f"FSDPParam._init_sharding_spec_spmd) is served on torch {torch.__version__} only as this torch's "
        "FSDP2 (+TP) over the data-parallel sub-mesh, with at most two non-data-parallel dims after the "
        "data-parallel ones")


@dataclass(frozen=True)
class _Spmd:
    """What 2.15 keeps of a parameter on the full mesh, for one this torch shards as FSDP+TP:
    ``spec`` (its DTensor spec there), ``plain`` (spmd_types: the unsharded parameter stays a plain
    tensor), ``grad_placements`` (spmd_types: its gradient's, on the full mesh), ``kept`` (the full
    mesh's dims that the TP sub-mesh keeps)."""

    spec: Any
    plain: bool
    grad_placements: Tuple[Any, ...]
    kept: Tuple[int, ...]


def _dp_mesh(module: Any, mesh: Any, dp_mesh_dims: Any, ignored: Any) -> Any:
    """The data-parallel mesh that sharding over ``dp_mesh_dims`` of the full ``mesh`` amounts to;
    where other dims have several ranks or parameters are DTensors on ``mesh``, the module's
    parameters become DTensors on the other dims' sub-mesh first (this torch's FSDP+TP input)."""
    from torch.distributed.tensor import DTensor

    from ..dtensor._internals import pointwise_keeps_strided_shard

    names = mesh.mesh_dim_names if mesh is not None else None
    if not names:
        raise ValueError("fully_shard(dp_mesh_dims=...) needs a mesh with mesh_dim_names (the full SPMD mesh)")
    shard, replicate = _names(dp_mesh_dims.shard), _names(dp_mesh_dims.replicate)
    missing = [name for name in shard + replicate if name not in names]
    if missing:
        raise ValueError(f"dp_mesh_dims names {missing} not in the mesh's dims {list(names)}")
    if len(replicate) > 1:
        raise _unserved("with several replicate dims")
    if not shard:
        raise _unserved("with replicate dims only (DDP over the full mesh)")
    if replicate and len(shard) > 1:
        raise _unserved("with HSDP over several shard dims")
    if replicate:
        dp_mesh = mesh[replicate + shard]
    else:
        dp_mesh = mesh[shard] if len(shard) == 1 else mesh[shard]._flatten()
    params = _unmanaged_params(module, ignored)
    others = [name for name in names if name not in shard + replicate]
    several = [name for name in others if mesh[name].size() > 1]
    if not several and not any(isinstance(param, DTensor) for _, _, param in params):
        for _, name, param in params:
            _storage(name, param, mesh, dp_mesh_dims)  # 2.15's errors for plain parameters
        return dp_mesh
    if several and dp_mesh.size() > 1 and _strided_fsdp_tp() and not pointwise_keeps_strided_shard():
        # measured: torchtitan 0.3.0's fsdp+tp+sac (dp_shard 2 x tp 2) on 2.9.0 loaded its fused wqkv
        # from the seed checkpoint with param.copy_(replicated), which this torch's pointwise strategy
        # places as Shard (other ranks' rows), and trained 6.5e-3 off one process
        raise _unserved(f"with data-parallel dims of {dp_mesh.size()} ranks beside {several} of several ranks "
                        "(FSDP+TP, HSDP+TP) while dtensor-strided-shard-pointwise is off: this torch's DTensor "
                        "pointwise ops (copy_ in load_state_dict) treat the parameters' _StridedShard as Shard "
                        "and would put other ranks' rows in them")
    _to_tp_params(params, mesh, dp_mesh_dims, others, several)
    return dp_mesh


def _strided_fsdp_tp() -> bool:
    """Whether this torch's FSDP2 labels an FSDP+TP parameter ``_StridedShard`` on the dp dim (2.5+); 2.4's
    labels it ``(TP placement, Shard(0))`` on the (tp, dp) mesh (fsdp2-2d-state-dict), which its pointwise
    ops place right."""
    import torch

    return torch.__version__ >= "2.5"


def _unmanaged_params(module: Any, ignored: Any) -> List[Tuple[Any, str, Any]]:
    """(owner, name, parameter) of the parameters this ``fully_shard`` call manages: not ignored,
    not under a submodule that an earlier ``fully_shard`` call manages."""
    from torch.distributed.fsdp import FSDPModule

    roots = module if isinstance(module, (list, tuple)) else [module]
    out, seen, stack = [], set(), list(roots)
    while stack:
        m = stack.pop()
        for name, param in m._parameters.items():
            if param is not None and id(param) not in seen and param not in ignored:
                seen.add(id(param))
                out.append((m, name, param))
        stack.extend(child for child in m.children() if not isinstance(child, FSDPModule))
    return out


def _storage(name: str, param: Any, mesh: Any, dp_mesh_dims: Any) -> Tuple[Any, Tuple[Any, ...]]:
    """A plain parameter's DTensor on the full mesh and its gradient's placements there, as 2.15
    makes them of spmd_types annotations (fsdp2-spmd-types' resolution, its ``ValueError``s);
    torch 2.15's ``ValueError`` for a plain parameter without them."""
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
    dtensor = _storage_dtensor(spmd, fsdp_param, param, local_type)
    return dtensor, fsdp_param._spmd_grad_placements


def _to_tp_params(params: List[Tuple[Any, str, Any]], mesh: Any, dp_mesh_dims: Any, others: List[str],
                  several: List[str]) -> None:
    """Replace each parameter by a DTensor on the sub-mesh of the non-data-parallel dims (at most two:
    this torch's FSDP2 takes 1-D TP/EP or 2-D EP+TP), remembering its full-mesh spec (:class:`_Spmd`)."""
    import torch.nn as nn
    from torch.distributed.tensor import DTensor

    names = list(mesh.mesh_dim_names)
    dp_names = set(dp_mesh_dims.shard_names + dp_mesh_dims.replicate_names)
    if not others:
        raise _unserved("with DTensor parameters on a mesh of data-parallel dims only")
    if max(names.index(name) for name in dp_names) > min(names.index(name) for name in others):
        raise _unserved(f"with mesh dims {others} not all after the data-parallel ones")
    tp_names = others if len(others) <= 2 else several
    if len(tp_names) > 2:
        raise _unserved(f"with {len(tp_names)} non-data-parallel dims of several ranks {tp_names}")
    kept = tuple(names.index(name) for name in tp_names)
    tp_mesh = mesh[tuple(tp_names)] if len(tp_names) > 1 else mesh[tp_names[0]]
    for owner, name, param in params:
        if isinstance(param, DTensor):
            # measured on a (dp_shard 2, tp 2) mesh: 2.13's losses and placements, not its gradients
            raise _unserved("with DTensor parameters on the full mesh (spmd_backend='full_dtensor'; "
                            "spmd_types-annotated plain parameters are served)")
        full, grad_placements = _storage(name, param, mesh, dp_mesh_dims)
        plain = True
        tp_param = nn.Parameter(DTensor.from_local(
            full._local_tensor, tp_mesh, [full.placements[i] for i in kept], run_check=False, shape=full.shape,
            stride=full.stride()), requires_grad=param.requires_grad)
        tp_param._torchpatch_spmd = _Spmd(full._spec, plain, tuple(grad_placements), kept)
        owner._parameters[name] = tp_param
    _wrap_fsdp_param()


_FSDP_PARAM: Dict[str, Any] = {}  # "wrap": FSDPParam's wraps to install; "wrapped": installed


def _wrap_fsdp_param() -> None:
    """FSDPParam's wraps installed when the first parameter they serve is made (before FSDPParam
    takes it): a ``fully_shard`` without ``dp_mesh_dims`` never calls in."""
    if _FSDP_PARAM.get("wrapped"):
        return
    wrap = _FSDP_PARAM.get("wrap")
    if wrap is None:
        raise _unserved("without this torch's FSDPParam patched (its module's hook did not run)")
    wrap()


def _init_sharded_param(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    param = args[0] if args else kwargs["param"]
    spmd = getattr(param, "_torchpatch_spmd", None)
    if spmd is not None:
        instance._torchpatch_spmd = spmd
    return wrapped(*args, **kwargs)


def _init_unsharded_param(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """2.15's unsharded parameter: plain (spmd_types) or a DTensor on the full mesh."""
    spmd = getattr(instance, "_torchpatch_spmd", None)
    if spmd is None:
        return wrapped(*args, **kwargs)
    tp_spec = instance._tp_spec
    if spmd.plain:
        instance.is_dtensor = False
    else:
        instance._tp_spec = spmd.spec
    try:
        return wrapped(*args, **kwargs)
    finally:
        instance.is_dtensor, instance._tp_spec = True, tp_spec


def _get_grad_inner_tensor(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The unsharded gradient (plain with the annotation's backward placements, or a DTensor on the full
    mesh) as a DTensor on the TP sub-mesh: this torch reduces it over the TP dims; FSDP, over the
    data-parallel ones (as 2.15 skips them)."""
    spmd = getattr(instance, "_torchpatch_spmd", None)
    if spmd is None:
        return wrapped(*args, **kwargs)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    grad = args[0] if args else kwargs.pop("grad")
    if isinstance(grad, AsyncCollectiveTensor):
        grad = grad.wait()
    if isinstance(grad, DTensor):
        grad, placements = grad._local_tensor, grad.placements
    else:
        placements = spmd.grad_placements
    grad = DTensor.from_local(grad, instance._tp_spec.mesh, [placements[i] for i in spmd.kept], run_check=False,
                              shape=instance._tp_spec.shape, stride=instance._tp_spec.stride)
    return wrapped(grad, *args[1:], **kwargs)


def _patch_fsdp_param(patcher: Patcher, param_module: ModuleType) -> bool:
    fsdp_param_type = param_module.FSDPParam
    if hasattr(fsdp_param_type, "_init_sharding_spec_spmd") or not hasattr(fsdp_param_type, "_get_grad_inner_tensor"):
        return False  # torch >= 2.12 shards over the full mesh itself

    def wrap() -> None:
        """Through this hook's patcher, which the engine keeps for changes made later (undone with the patch)."""
        _FSDP_PARAM["wrapped"] = True
        patcher.wrap(fsdp_param_type, "_init_sharded_param", _init_sharded_param)
        patcher.wrap(fsdp_param_type, "init_unsharded_param", _init_unsharded_param)
        patcher.wrap(fsdp_param_type, "_get_grad_inner_tensor", _get_grad_inner_tensor)

    _FSDP_PARAM.clear()
    _FSDP_PARAM["wrap"] = wrap
    patcher.on_undo(_FSDP_PARAM.clear)
    return True


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
for _param_home in ("torch.distributed.fsdp._fully_shard._fsdp_param", "torch.distributed._composable.fsdp._fsdp_param"):
    PATCH.on_import(_param_home)(_patch_fsdp_param)

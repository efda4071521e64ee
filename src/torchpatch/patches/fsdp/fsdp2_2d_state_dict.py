"""fsdp2-2d-state-dict: the state dict (and ``full_tensor()``) of parameters sharded by FSDP2 and tensor
parallelism (FSDP over a 2-D mesh), torch 2.4.

What breaks:   ``model.state_dict()``, ``model.load_state_dict()`` and everything built on them
               (``torch.distributed.checkpoint.state_dict.get_model_state_dict``, DCP save and load,
               torchtitan's checkpointer, which takes the model's state dict when it is built) raise
               ``NotImplementedError: 2D state_dict is under development. Please check
               https://github.com/pytorch/pytorch/issues/129627 for more details.`` on every module
               holding a parameter that ``fully_shard`` shards over a data-parallel mesh dim after
               tensor parallelism sharded it. Behind the error: torch 2.4's FSDP2 labels such a
               parameter ``(Shard(0), <TP placement>)`` on the (dp, tp) mesh, which says "dp shards
               dim 0 first, then tp shards each part", while FSDP2 stores the reverse (dp's chunk of
               TP's shard): for a TP ``Shard(0)`` weight, ``full_tensor()`` (and any redistribution)
               silently returns the rows in the wrong order, and DCP would save and load each shard
               at another rank's offsets. Torch 2.5 labels them ``_StridedShard``, a placement 2.4's
               sharding propagation and redistribution lack.
Torch:         2.4 (read in 2.4.1's ``_composable/fsdp``); 2.5 supports the 2-D state dict.
Fix:           without a new placement: the same layout is plain nested sharding on the mesh with its
               dims in the other order. For FSDP (not HSDP) over a TP'd parameter, the sharded
               parameter (and so its gradient and the optimizer's states made like it) is labelled
               ``(<TP placement>, Shard(0))`` on the (tp, dp) mesh: the same ranks and process groups
               as the (dp, tp) mesh FSDP was given, dims swapped. That label says what FSDP2 stores,
               so ``full_tensor()``, redistribution and DCP's offsets are right, and the state dict
               pre-hooks that raise are removed from the modules whose 2-D parameters are so
               labelled. FSDP2's all-gather and reduce-scatter do not read the label (they use the
               data-parallel group and the TP spec), so training is unchanged. What differs from
               torch >= 2.5: such a parameter's ``device_mesh`` is the (tp, dp) mesh (2.5: (dp, tp)
               with ``_StridedShard``). HSDP + TP, which 2.4's FSDP2 refuses, is fsdp2-hsdp-tp's (it
               labels its parameters with this patch's helpers, and this patch removes the hooks).
Upstream:      https://github.com/pytorch/pytorch/issues/129627 (the 2-D state dict);
               https://github.com/pytorch/pytorch/pull/130760 (FSDP2 labels them ``_StridedShard`` "for
               correct full_tensor() result"), https://github.com/pytorch/pytorch/pull/126697 (the
               placement)
"""

from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="fsdp2-2d-state-dict",
    summary="FSDP2 + TP state dict (and DCP) on torch 2.4: 2-D parameters labelled with the layout FSDP2 stores",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/issues/129627",
    behaviour="state_dict / DCP / full_tensor of parameters sharded with fully_shard over a 2-D mesh with tensor parallelism",
    category="correctness",  # full_tensor() and redistribution of such a parameter read its rows in the wrong order
)

_MARK = "_torchpatch_2d_spec"  # on an FSDPParam whose sharded spec a patch relabelled (also fsdp2-hsdp-tp)
_PERMUTED: Dict[Tuple[int, Tuple[int, ...]], Tuple[Any, Any]] = {}  # (id of a mesh, order) -> (mesh, permuted)


def permuted(mesh: Any, order: Tuple[int, ...]) -> Any:
    """``mesh`` with its dims in ``order``: the same ranks and process groups (the (tp, dp) mesh of a 2-D
    (dp, tp) mesh for ``order == (1, 0)``)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (id(mesh), order)
    entry = _PERMUTED.get(key)
    if entry is not None and entry[0] is mesh:
        return entry[1]
    names = mesh.mesh_dim_names
    result = DeviceMesh(mesh.device_type, mesh.mesh.permute(order).contiguous(),
                        mesh_dim_names=tuple(names[d] for d in order) if names else None, _init_backend=False)
    result._dim_group_infos = [mesh._dim_group_infos[d] for d in order]
    result._parent_mesh = getattr(mesh, "_parent_mesh", None)
    _PERMUTED[key] = (mesh, result)  # keeps mesh alive: the id stays its own
    return result


def relabel(fsdp_param: Any, mesh: Any, placements: Tuple[Any, ...]) -> None:
    """Give ``fsdp_param``'s sharded parameter (and the gradients made from its spec) the label
    ``placements`` on ``mesh``: the data it holds stays as it is."""
    import torch.nn as nn
    from torch.distributed._tensor.placement_types import DTensorSpec

    spec = fsdp_param._sharding_spec
    fsdp_param._sharding_spec = DTensorSpec(mesh, tuple(placements), tensor_meta=spec.tensor_meta)
    old = fsdp_param.sharded_param
    new = nn.Parameter(fsdp_param.to_sharded_dtensor(old._local_tensor))
    new.requires_grad_(old.requires_grad)
    fsdp_param.sharded_param = new
    fsdp_param._setattr_on_modules(new)
    setattr(fsdp_param, _MARK, True)


def _init_sharded_param(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    spec = instance._sharding_spec
    if not (instance.is_dtensor and spec.mesh.ndim == 2 and len(spec.placements) == 2
            and spec.placements[0].is_shard(0) and instance._tp_spec.mesh.ndim == 1):
        return result  # FSDP alone, or HSDP (+ TP: fsdp2-hsdp-tp labels it): the label says what is stored
    relabel(instance, permuted(spec.mesh, (1, 0)), (spec.placements[1], spec.placements[0]))
    return result


def _group_init(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    modules: Dict[int, Any] = {}
    unlabelled = set()
    for fsdp_param in instance.fsdp_params:
        module = fsdp_param._module_info.module
        if len(fsdp_param._spmd_placements) > 1:
            modules[id(module)] = module
            if not getattr(fsdp_param, _MARK, False):
                unlabelled.add(id(module))
    for key, module in modules.items():
        if key in unlabelled:
            continue  # HSDP without TP: torch 2.4's refusal stays
        for hooks in (module._state_dict_pre_hooks, module._load_state_dict_pre_hooks):
            for handle_id, hook in list(hooks.items()):
                if getattr(getattr(hook, "hook", hook), "__name__", "") == "_raise_not_implemented_if_2d":
                    del hooks[handle_id]
    return result


@PATCH.on_import("torch.distributed._composable.fsdp._fsdp_param_group")
def label_2d_parameters(patcher: Patcher, module: Any) -> bool:
    import importlib

    from torchpatch.patches._source import torch_source

    if "_raise_not_implemented_if_2d" not in torch_source(module.FSDPParamGroup.__init__):
        return False  # a torch with the 2-D state dict
    param_module = importlib.import_module("torch.distributed._composable.fsdp._fsdp_param")
    patcher.wrap(param_module.FSDPParam, "_init_sharded_param", _init_sharded_param)
    patcher.wrap(module.FSDPParamGroup, "__init__", _group_init)
    return True

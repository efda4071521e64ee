"""dcp-checkpointable-tensor: ``torch.distributed.checkpoint.protocol.CheckpointableTensor`` (also
exported from ``torch.distributed.checkpoint``) and what it means to DCP's planner, on torch 2.4-2.13.

What breaks:   code written for torch >= 2.14 that checkpoints a plain local tensor as shards of a
               global tensor, by giving it the fields ``global_shape``, ``global_offsets``,
               ``local_offsets`` and ``local_sizes`` (one or several shards per rank, padding), dies
               with ``ModuleNotFoundError: No module named 'torch.distributed.checkpoint.protocol'``;
               without the import, ``dcp.save`` silently writes each rank's whole local tensor under
               the name (the ranks' entries collide) and ``dcp.load`` raises a size mismatch (2.6+)
               or reads the wrong region (2.4-2.5).
Torch:         2.14 added the Protocol and consults it in its DCP planner; 2.4-2.13 lack both (their
               ``planner_helpers``, ``default_planner`` and ``utils`` have the same structure).
Fix:           serve the ``protocol`` module (the runtime-checkable Protocol and its helpers,
               ``_checkpointable_tensor``) and make the installed planner treat such a tensor as 2.14
               does: ``planner_helpers._create_write_items`` and ``_create_default_metadata_only_plan``
               make one ``SHARD`` write item per shard, sized as the global tensor;
               ``_create_chunk_list`` gives the shards' chunks (so ``_create_read_items`` plans
               reads of them); ``_init_state_dict`` keeps the fields on a meta tensor it materialises;
               ``default_planner.create_default_local_load_plan`` compares the saved size with
               ``global_shape``; ``utils.find_tensor_shard`` returns the view of the local tensor
               that holds the shard an item names. The fields are validated with 2.14's errors. Any
               other value goes to torch's own code after one ``isinstance`` check.
Upstream:      https://github.com/pytorch/pytorch/pull/189492
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-checkpointable-tensor",
    summary="torch.distributed.checkpoint.protocol.CheckpointableTensor: plain tensors saved and loaded as global-tensor shards",
    torch=">=2.4,<2.14",
    upstream="https://github.com/pytorch/pytorch/pull/189492",
    behaviour="dcp.save / dcp.load of plain tensors carrying CheckpointableTensor's fields",
)

MODULE = "torch.distributed.checkpoint.protocol"
PUBLIC = ("CheckpointableTensor",)
# the private helpers 2.15's module holds, which its planner code imports from it
HELPERS = ("_is_checkpointable_tensor", "_copy_checkpointable_tensor_metadata",
           "_validate_checkpointable_tensor_metadata", "_get_checkpointable_tensor_chunks",
           "_get_checkpointable_tensor_shard")
PATCH.sets(MODULE, PUBLIC + HELPERS)

Wrapper = Callable[[Callable[..., Any], Any, Tuple[Any, ...], Dict[str, Any]], Any]


def _impl() -> ModuleType:
    return importlib.import_module("torchpatch.patches.checkpoint._checkpointable_tensor")


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    impl = _impl()
    for name in PUBLIC + HELPERS:
        setattr(module, name, getattr(impl, name))
    module.__all__ = list(PUBLIC)


@PATCH.symbol("torch.distributed.checkpoint", "CheckpointableTensor")
def _exported() -> Any:
    return importlib.import_module(MODULE).CheckpointableTensor


def _first(args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str) -> Any:
    return args[0] if args else kwargs[name]


def _second(args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str) -> Any:
    return args[1] if len(args) > 1 else kwargs[name]


def _wrappers(helpers: ModuleType, served: Callable[[Any], bool]) -> Dict[str, Wrapper]:
    """The wrappers of ``planner_helpers``' functions: 2.14's behaviour for a ``served`` tensor, the
    installed function's for anything else."""
    impl = _impl()

    def write_items(wrapped: Callable[..., Any], _instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        obj = _second(args, kwargs, "object")
        return impl.write_items(_first(args, kwargs, "fqn"), obj) if served(obj) else wrapped(*args, **kwargs)

    def metadata_only_plan(wrapped: Callable[..., Any], _instance: Any, args: Tuple[Any, ...],
                           kwargs: Dict[str, Any]) -> Any:
        state_dict = _first(args, kwargs, "state_dict")
        if not any(served(obj) for obj in state_dict.values()):
            return wrapped(*args, **kwargs)
        items: List[Any] = []
        for fqn, obj in state_dict.items():
            items += impl.write_items(fqn, obj) if served(obj) else wrapped({fqn: obj}).items
        return helpers.SavePlan(items)

    def chunk_list(wrapped: Callable[..., Any], _instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        tensor = _first(args, kwargs, "tensor")
        return impl._get_checkpointable_tensor_chunks(tensor) if served(tensor) else wrapped(*args, **kwargs)

    def init_state_dict(wrapped: Callable[..., Any], _instance: Any, args: Tuple[Any, ...],
                        kwargs: Dict[str, Any]) -> Any:
        _materialise_meta(_first(args, kwargs, "state_dict"), served, impl._copy_checkpointable_tensor_metadata)
        return wrapped(*args, **kwargs)

    return {"_create_write_items": write_items, "_create_default_metadata_only_plan": metadata_only_plan,
            "_create_chunk_list": chunk_list, "_init_state_dict": init_state_dict}


def _materialise_meta(container: Any, served: Callable[[Any], bool], copy_fields: Callable[[Any, Any], None]) -> None:
    """Replace each meta-device ``served`` tensor in the (nested) dicts and lists of ``container``
    by an empty one on the default process group's device, with the same fields."""
    import torch
    import torch.distributed as dist
    from torch._utils import _get_device_module

    keys = container.keys() if isinstance(container, dict) else range(len(container)) if isinstance(container, list) else ()
    for key in keys:
        value = container[key]
        if served(value) and value.device == torch.device("meta"):
            device_type = dist.distributed_c10d._get_pg_default_device().type
            tensor = torch.empty_like(value, device=_get_device_module(device_type).current_device())
            copy_fields(value, tensor)
            container[key] = tensor
        elif isinstance(value, (dict, list)):
            _materialise_meta(value, served, copy_fields)


def _local_load_plan(helpers: ModuleType, served: Callable[[Any], bool]) -> Wrapper:
    """``create_default_local_load_plan``: a ``served`` tensor's saved size is compared with its
    ``global_shape`` and its reads planned from its shards; other entries are planned by torch."""

    def plan(wrapped: Callable[..., Any], _instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        import torch
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan

        state_dict, metadata = _first(args, kwargs, "state_dict"), _second(args, kwargs, "metadata")
        strict = args[2] if len(args) > 2 else kwargs.get("strict", True)
        ours = [served(obj) for obj in state_dict.values()]
        if not any(ours):
            return wrapped(*args, **kwargs)
        requests: List[Any] = []
        for (fqn, obj), served_here in zip(state_dict.items(), ours):
            md = metadata.state_dict_metadata.get(fqn)
            if not served_here or md is None:  # a missing key: torch's error, or skipped if not strict
                requests += wrapped({fqn: obj}, metadata, strict).items
                continue
            size = torch.Size(obj.global_shape)
            if isinstance(md, TensorStorageMetadata) and md.size != size:
                raise ValueError(f"Size mismatch between saved {md.size} and current: {size} for {fqn}")
            requests += helpers._create_read_items(fqn, md, obj)
        return LoadPlan(requests)

    return plan


@PATCH.on_import("torch.distributed.checkpoint.default_planner")
def plan_checkpointable_tensors(patcher: Patcher, planner: ModuleType) -> bool:
    helpers = importlib.import_module("torch.distributed.checkpoint.planner_helpers")
    utils = importlib.import_module("torch.distributed.checkpoint.utils")
    if hasattr(helpers, "_get_checkpointable_tensor_write_items"):
        return False  # torch >= 2.14 plans them itself
    impl = _impl()

    def served(obj: Any) -> bool:  # a DTensor keeps its own planning, as on 2.14
        return impl._is_checkpointable_tensor(obj) and not isinstance(obj, helpers.DTensor)

    def find_shard(wrapped: Callable[..., Any], _instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        tensor = _first(args, kwargs, "tensor")
        if served(tensor):
            return impl._get_checkpointable_tensor_shard(tensor, _second(args, kwargs, "index"))
        return wrapped(*args, **kwargs)

    for name, wrapper in _wrappers(helpers, served).items():
        original = getattr(helpers, name)
        proxy = patcher.wrap(helpers, name, wrapper)
        if getattr(planner, name, None) is original:  # default_planner imported it by name
            patcher.setattr(planner, name, proxy)
    patcher.wrap(planner, "create_default_local_load_plan", _local_load_plan(helpers, served))
    patcher.wrap(utils, "find_tensor_shard", find_shard)
    return True

"""device-mesh-unflatten: ``DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names, backend_override=None)``
on torch 2.4-2.9.

What breaks:   torchtitan 0.3.0 (and 0.2.2) builds every mesh by unflattening its 1-D world mesh
               (``world_mesh._unflatten(0, (pp, batch, cp, tp), ("pp", "batch", "cp", "tp"),
               backend_override={...: "fake"})``), so on torch 2.4-2.9 nothing trains: ``AttributeError:
               'DeviceMesh' object has no attribute '_unflatten'``.
Torch:         2.10 rebuilt DeviceMesh on rank layouts (``_layout``) and added ``_unflatten``: dimension
               ``dim`` becomes ``len(mesh_sizes)`` dimensions of those sizes and names (row-major), with
               one new process group per new dimension (``backend_override`` by name or index, torch's
               ``"fake"`` backend for groups that never communicate), the other dimensions' groups kept;
               the result is sliced and flattened like any mesh. 2.9's DeviceMesh is the older
               tensor-of-ranks one, without layouts.
Fix:           on 2.9, the same checks and errors as 2.15, then a new 2.9 DeviceMesh over ``self.mesh``
               with ``dim`` unflattened, the names spliced in and the backend overrides on the new
               dimensions (``"fake"`` registers torch's fake backend first, as 2.15 has it built in).
               Its other dimensions get new process groups too (same ranks, so the same results). As in
               2.15, its submeshes and flattened dimensions have the root of the mesh it was unflattened
               from (2.9's ``_mesh_resources.get_root_mesh``), so FSDP's check that the DP and TP meshes
               share a parent passes when they come from two unflattenings of one world mesh; 2.9 slices
               and flattens within one tensor of ranks, so that root (and each unflattened mesh) slices a
               name it lacks from the first mesh unflattened from it that has all the names (FSDP's
               ``root[dp_names + tp_names]``, 2.15's concatenation), and a submesh is flattened in the
               unflattened mesh that has its names, the flattened name then also recorded on the root.
               The unflattened mesh itself stays a root of its own in 2.9's records (slicing it does
               not warn of slicing a submesh).
               On 2.4 (no backend overrides, no root records): the new mesh over ``self.mesh`` with
               ``dim`` unflattened, its groups all of the default backend (a ``"fake"`` one asked for
               becomes a real group: the same results, more groups), 2.15's errors for the override keys;
               it is a root of its own, its slices and flattenings (device-mesh-flatten) know it as
               their parent. Two unflattenings of one world mesh do not share a parent there; the
               unflattenings of each mesh are recorded, and FSDP2's check that the DP and TP meshes
               share a parent is fsdp2-unflattened-meshes'.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/device_mesh.py
"""

import math
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="device-mesh-unflatten",
    summary="DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names, backend_override) on torch 2.4-2.9 "
    "(torchtitan 0.2.2 and 0.3.0 build their meshes with it)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/device_mesh.py",
)
PATCH.sets("torch.distributed.device_mesh.DeviceMesh", ("_unflatten",))

_UNFLATTENED: Dict[Any, List[Any]] = {}  # root mesh -> the meshes unflattened from it or its submeshes


def _register_fake_backend() -> None:
    import importlib

    import torch.distributed as dist

    if "fake" not in dist.Backend.backend_list:  # importing the module registers the "fake" backend
        importlib.import_module("torch.testing._internal.distributed.fake_pg")


def _unflatten(self: Any, dim: Union[int, str], mesh_sizes: Tuple[int, ...], mesh_dim_names: Tuple[str, ...],
               backend_override: Optional[Dict[Union[int, str], Any]] = None) -> Any:
    """``self`` with dimension ``dim`` unflattened into ``mesh_sizes`` named ``mesh_dim_names``."""
    from torch.distributed import device_mesh

    names = tuple(self.mesh_dim_names or ())
    if isinstance(dim, int) and dim >= self.ndim:
        raise ValueError(f"dim {dim} specified in `_unflatten` is out of range {self.ndim}")
    if isinstance(dim, str) and dim not in names:
        raise ValueError(f"dim {dim} specified in `_unflatten` is not in {self.mesh_dim_names}")
    if len(mesh_sizes) != len(mesh_dim_names):
        raise RuntimeError("mesh_dim_names must have same length as mesh_sizes in _unflatten!")
    dim = names.index(dim) if isinstance(dim, str) else dim
    size = self.mesh.size(dim)
    if math.prod(mesh_sizes) != size:
        raise ValueError(
            f"The product of mesh_sizes={tuple(mesh_sizes)} is {math.prod(mesh_sizes)}, but the original dimension "
            f"at dim={dim} has size {size}. These must be equal for unflatten to work correctly.")
    dim_names = list(names) if names else [f"dim_{i}" for i in range(self.ndim)]
    dim_names[dim:dim + 1] = list(mesh_dim_names)
    ranks = self.mesh.unflatten(dim, tuple(mesh_sizes))
    if not hasattr(device_mesh, "_normalize_backend_override"):
        # torch 2.4: no backend overrides; every dimension gets groups of the default backend (a "fake"
        # one asked for, for a group that never communicates, becomes a real one: the same results)
        _check_override_keys(backend_override, tuple(mesh_dim_names))
        unflattened = device_mesh.DeviceMesh(self.device_type, ranks, mesh_dim_names=tuple(dim_names))
        _UNFLATTENED.setdefault(_shared_root(self), []).append(unflattened)  # fsdp2-unflattened-meshes reads it
        return unflattened
    overrides = ((None, None),) * len(mesh_sizes)
    if backend_override is not None:
        overrides = tuple(device_mesh._normalize_backend_override(
            dict(backend_override), len(mesh_sizes), tuple(mesh_dim_names)))
        if any(backend == "fake" for backend, _ in overrides):
            _register_fake_backend()
    all_overrides = ((None, None),) * dim + overrides + ((None, None),) * (self.ndim - dim - 1)
    root = _shared_root(self)
    unflattened = device_mesh.DeviceMesh(self.device_type, ranks, mesh_dim_names=tuple(dim_names),
                                         backend_override=all_overrides)
    _UNFLATTENED.setdefault(root, []).append(unflattened)
    return unflattened


def _check_override_keys(backend_override: Optional[Dict[Union[int, str], Any]], names: Tuple[str, ...]) -> None:
    """2.15's errors for ``backend_override`` keys: one that names no new dimension, or a dimension given
    by both its index and its name."""
    keys = list(backend_override or {})
    for index, name in enumerate(names):
        if index in keys and name in keys:
            raise RuntimeError(f"Found redundant dim index {index} and name {name} in backend_override")
    if any(key not in names and not (isinstance(key, int) and 0 <= key < len(names)) for key in keys):
        raise RuntimeError(f"Found invalid keys in backend_override: got {keys}, "
                           f"expected integers in range [0, {len(names)}) or one of {names}")


def _shared_root(mesh: Any) -> Any:
    """2.15's root of ``mesh``: for an unflattened mesh, the root of the mesh it was unflattened from
    (2.4: the parent of ``mesh``, or ``mesh``, stands for its root)."""
    from torch.distributed.device_mesh import _mesh_resources

    if hasattr(_mesh_resources, "get_root_mesh"):
        root = _mesh_resources.get_root_mesh(mesh)
    else:
        root = _mesh_resources.get_parent_mesh(mesh) or mesh
    return next((origin for origin, meshes in _UNFLATTENED.items() if any(root is m for m in meshes)), root)


def unflattened_alongside(mesh: Any) -> List[Any]:
    """The meshes unflattened from the root ``mesh`` was unflattened from (``mesh`` among them), in the
    order made; empty for a mesh ``_unflatten`` did not make."""
    return next((list(meshes) for meshes in _UNFLATTENED.values() if any(mesh is m for m in meshes)), [])


def _has_names(mesh: Any, names: Tuple[str, ...]) -> bool:
    from torch.distributed.device_mesh import _mesh_resources

    known = set(mesh.mesh_dim_names or ()) | set(_mesh_resources.flatten_name_to_root_dims.get(mesh, {}))
    return set(names) <= known


def _unflattened_with(root: Any, names: Tuple[str, ...]) -> Any:
    """The first mesh unflattened from ``root`` that has all ``names``, else None."""
    return next((mesh for mesh in _UNFLATTENED.get(root, ()) if _has_names(mesh, names)), None)


def _getitem(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Slicing that records 2.15's root; the root or an unflattened mesh slices names it lacks from the
    first mesh unflattened from the root that has them all."""
    from torch.distributed.device_mesh import _mesh_resources

    root = _shared_root(instance)
    if root not in _UNFLATTENED:
        return wrapped(*args, **kwargs)
    names = args[0] if args else kwargs["mesh_dim_names"]
    names = (names,) if isinstance(names, str) else tuple(names)
    source = instance
    if not _has_names(instance, names) and (instance is root or any(instance is m for m in _UNFLATTENED[root])):
        source = _unflattened_with(root, names) or instance
    submesh = wrapped.__func__(source, names)
    if submesh is not source:
        _mesh_resources.child_to_root_mapping[submesh] = root
    return submesh


def _flatten(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Flattening an unflattened mesh or its submesh: done in that unflattened mesh (2.9 flattens within
    the root's tensor of ranks), recorded on the shared root too."""
    from torch.distributed.device_mesh import _mesh_resources

    root = _shared_root(instance)
    unflattened = _UNFLATTENED.get(root, [])
    if any(instance is mesh for mesh in unflattened):
        flattened = wrapped(*args, **kwargs)
    else:
        source = _unflattened_with(root, tuple(instance.mesh_dim_names or ()))
        if instance is root or source is None:
            return wrapped(*args, **kwargs)
        roots = _mesh_resources.child_to_root_mapping
        roots[instance] = source
        try:
            flattened = wrapped(*args, **kwargs)
        finally:
            roots[instance] = root
    _mesh_resources.child_to_root_mapping[flattened] = root
    _mesh_resources.root_to_flatten_mapping.setdefault(root, {})[flattened.mesh_dim_names[0]] = flattened
    return flattened


@PATCH.on_import("torch.distributed.device_mesh")
def add_unflatten(patcher: Patcher, device_mesh: ModuleType) -> Optional[bool]:
    mesh_class = getattr(device_mesh, "DeviceMesh", None)
    if mesh_class is None or hasattr(mesh_class, "_unflatten"):
        return False
    patcher.setattr(mesh_class, "_unflatten", _unflatten)
    if not hasattr(device_mesh._mesh_resources, "get_root_mesh"):
        return True  # torch 2.4: each unflattened mesh is a root; its slices know it as their parent
    patcher.wrap(mesh_class, "__getitem__", _getitem)
    patcher.wrap(mesh_class, "_flatten", _flatten)
    return True

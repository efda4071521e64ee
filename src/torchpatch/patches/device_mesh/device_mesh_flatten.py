"""device-mesh-flatten: ``DeviceMesh._flatten`` and slicing a mesh by a flattened name on torch 2.4.

What breaks:   torchtitan (2025) builds its data-parallel meshes by flattening dimensions of the
               world mesh, ``mesh["dp_replicate", "dp_shard"]._flatten("dp")``, and later slices
               the world mesh by the new name (``world_mesh["dp"]``, ``world_mesh["dp_shard_cp"]``);
               on torch 2.4 every data-parallel configuration stops at
               ``AttributeError: 'DeviceMesh' object has no attribute '_flatten'``.
Torch:         2.4 (DeviceMesh has slicing by names but no flattening); 2.5 added both.
Fix:           ``_flatten(mesh_dim_name=None)`` with torch 2.5's semantics: the dimensions of the
               (sliced) mesh, taken in the root mesh, become one dimension named ``mesh_dim_name``
               (default: the names joined by ``_``); every rank builds the 1-D mesh of every group
               (a new process group each, created in the same order on all ranks, as torch 2.5
               does) and keeps its own; a second call with the same name returns the same mesh. The
               root mesh then answers ``root[name]`` and ``root[(name,)]`` with it, and
               ``root["dp_shard_cp", "tp"]`` (FSDP2 + TP slices that) with the submesh over the
               root dimensions the names stand for, in the root's order, each flattened name one
               dimension using its flattened group (torch 2.5's semantics).
Upstream:      https://github.com/pytorch/pytorch/pull/132632 (``_flatten``, torch 2.5),
               https://github.com/pytorch/pytorch/pull/133839 (slicing by the flattened name)
"""

import math
from typing import Any, Dict, Optional, Tuple, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="device-mesh-flatten",
    summary="DeviceMesh._flatten and slicing the root mesh by the flattened name",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/132632",
    behaviour="root_mesh[flattened_name]",
)
PATCH.sets("torch.distributed.device_mesh.DeviceMesh", ("_flatten",))  # a member: on the class's dotted name

# root mesh -> flattened name -> (the flattened 1-D mesh of this rank, the root dimensions it spans);
# root meshes live as long as the job (torch 2.5 keeps the same mappings in its _MeshEnv).
_FLATTENED: Dict[Any, Dict[str, Tuple[Any, Tuple[int, ...]]]] = {}


def _root(mesh: Any) -> Any:
    from torch.distributed.device_mesh import _mesh_resources

    parent = _mesh_resources.get_parent_mesh(mesh)
    return mesh if parent is None else parent


def _flatten(self: Any, mesh_dim_name: Optional[str] = None) -> Any:
    """A 1-D mesh over this mesh's dimensions, named ``mesh_dim_name`` (torch 2.5's ``_flatten``)."""
    from torch.distributed.device_mesh import DeviceMesh, _mesh_resources

    if not self.mesh_dim_names:
        raise RuntimeError("Cannot flatten a DeviceMesh without mesh_dim_names!")
    root = _root(self)
    name = mesh_dim_name or "_".join(self.mesh_dim_names)
    done = _FLATTENED.setdefault(root, {})
    if name in done:
        return done[name][0]
    if name in (root.mesh_dim_names or ()):
        raise RuntimeError(f"{name!r} already exists in the root mesh's dimension names {root.mesh_dim_names}")
    dims = [root.mesh_dim_names.index(n) for n in self.mesh_dim_names]
    rest = [d for d in range(root.mesh.ndim) if d not in dims]
    rows = root.mesh.permute(*rest, *dims).reshape(-1, math.prod(self.mesh.size()))
    rank = root.get_rank()
    for row in rows:  # every rank creates every group, in the same order
        mesh = DeviceMesh(root.device_type, row, mesh_dim_names=(name,))
        if rank in row:
            done[name] = (mesh, tuple(dims))
    # its root, as torch 2.5 records it (FSDP2 + TP checks that both meshes share one)
    _mesh_resources.child_to_parent_mapping[done[name][0]] = root
    return done[name][0]


def _mixed_slice(root: Any, names: Tuple[str, ...]) -> Any:
    """``root[names]`` where some names are flattened dimensions: the submesh of this rank over the
    root dimensions they stand for, each flattened name one dimension with its flattened group."""
    from torch.distributed.device_mesh import DeviceMesh, _mesh_resources

    flattened = _FLATTENED[root]
    spans = [flattened[n][1] if n in flattened else (root.mesh_dim_names.index(n),) for n in names]
    dims = [d for span in spans for d in span]
    if dims != sorted(set(dims)):
        raise KeyError(f"invalid mesh dimensions {names}: their root dimensions {spans} must be distinct and "
                       f"in the order of the root mesh's {root.mesh_dim_names}")
    rest = [d for d in range(root.mesh.ndim) if d not in dims]
    sizes = [math.prod(root.mesh.size(d) for d in span) for span in spans]
    rank = root.get_rank()
    submesh = next(sub for sub in root.mesh.permute(*rest, *dims).reshape(-1, *sizes) if rank in sub)
    mesh = DeviceMesh(root.device_type, submesh, mesh_dim_names=names, _init_backend=False)
    mesh._dim_group_infos = [flattened[n][0]._dim_group_infos[0] if n in flattened else root._dim_group_infos[span[0]]
                             for n, span in zip(names, spans)]
    _mesh_resources.child_to_parent_mapping[mesh] = root
    return mesh


def _getitem(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    names: Union[str, Tuple[str, ...]] = args[0] if args else kwargs["mesh_dim_names"]
    names = (names,) if isinstance(names, str) else tuple(names)
    flattened = _FLATTENED.get(instance, {})
    if not any(n in flattened and n not in (instance.mesh_dim_names or ()) for n in names):
        return wrapped(*args, **kwargs)
    if len(names) == 1:
        return flattened[names[0]][0]
    return _mixed_slice(instance, names)


@PATCH.on_import("torch.distributed.device_mesh")
def add_flatten(patcher: Patcher, device_mesh: Any) -> bool:
    if hasattr(device_mesh.DeviceMesh, "_flatten"):
        return False
    patcher.setattr(device_mesh.DeviceMesh, "_flatten", _flatten)
    patcher.wrap(device_mesh.DeviceMesh, "__getitem__", _getitem)
    return True

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
               root mesh then answers ``root[name]`` and ``root[(name,)]`` with it. Slicing a
               flattened name together with other dimensions (``root["dp", "tp"]``, torch >= 2.6)
               raises ``KeyError`` naming that limit.
Upstream:      https://github.com/pytorch/pytorch/pull/132632 (``_flatten``, torch 2.5),
               https://github.com/pytorch/pytorch/pull/133839 (slicing by the flattened name)
"""

import math
from typing import Any, Dict, Optional, Tuple, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="device-mesh-flatten",
    summary="DeviceMesh._flatten and slicing the root mesh by the flattened name on torch 2.4",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/132632",
    behaviour="root_mesh[flattened_name]",
)
PATCH.sets("torch.distributed.device_mesh", ("DeviceMesh._flatten",))

# root mesh -> flattened name -> the flattened 1-D mesh of this rank (root meshes live as long as
# the job; torch 2.5 keeps the same mapping in its _MeshEnv).
_FLATTENED: Dict[Any, Dict[str, Any]] = {}


def _root(mesh: Any) -> Any:
    from torch.distributed.device_mesh import _mesh_resources

    parent = _mesh_resources.get_parent_mesh(mesh)
    return mesh if parent is None else parent


def _flatten(self: Any, mesh_dim_name: Optional[str] = None) -> Any:
    """A 1-D mesh over this mesh's dimensions, named ``mesh_dim_name`` (torch 2.5's ``_flatten``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not self.mesh_dim_names:
        raise RuntimeError("Cannot flatten a DeviceMesh without mesh_dim_names!")
    root = _root(self)
    name = mesh_dim_name or "_".join(self.mesh_dim_names)
    done = _FLATTENED.setdefault(root, {})
    if name in done:
        return done[name]
    if name in (root.mesh_dim_names or ()):
        raise RuntimeError(f"{name!r} already exists in the root mesh's dimension names {root.mesh_dim_names}")
    dims = [root.mesh_dim_names.index(n) for n in self.mesh_dim_names]
    rest = [d for d in range(root.mesh.ndim) if d not in dims]
    rows = root.mesh.permute(*rest, *dims).reshape(-1, math.prod(self.mesh.size()))
    rank = root.get_rank()
    for row in rows:  # every rank creates every group, in the same order
        mesh = DeviceMesh(root.device_type, row, mesh_dim_names=(name,))
        if rank in row:
            done[name] = mesh
    return done[name]


def _getitem(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    names: Union[str, Tuple[str, ...]] = args[0] if args else kwargs["mesh_dim_names"]
    names = (names,) if isinstance(names, str) else tuple(names)
    flattened = _FLATTENED.get(instance, {})
    if len(names) == 1 and names[0] in flattened and names[0] not in (instance.mesh_dim_names or ()):
        return flattened[names[0]]
    mixed = [n for n in names if n in flattened]
    if mixed:
        raise KeyError(
            f"slicing flattened mesh dimensions {mixed} together with other dimensions {names} needs torch >= 2.6; "
            f"torch 2.4 with torchpatch slices a flattened dimension only on its own (root_mesh[{mixed[0]!r}])"
        )
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.distributed.device_mesh")
def add_flatten(patcher: Patcher, device_mesh: Any) -> bool:
    if hasattr(device_mesh.DeviceMesh, "_flatten"):
        return False
    patcher.setattr(device_mesh.DeviceMesh, "_flatten", _flatten)
    patcher.wrap(device_mesh.DeviceMesh, "__getitem__", _getitem)
    return True

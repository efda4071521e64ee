"""device-mesh-unflatten-24: ``DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names, backend_override=None)``
on torch 2.4.

What breaks:   torchtitan 0.2.2 builds its meshes by unflattening its 1-D world mesh three times
               (``world_mesh._unflatten(0, (pp, batch, cp, tp), ("pp", "batch", "cp", "tp"),
               backend_override={...: "fake"})``, then ``("pp", "dp_replicate", "fsdp", "tp")`` and the
               expert dimensions) at its first training step, so on torch 2.4 nothing trains:
               ``AttributeError: 'DeviceMesh' object has no attribute '_unflatten'``.
Torch:         2.10 added ``_unflatten`` (device-mesh-unflatten serves it on 2.9): dimension ``dim``
               becomes ``len(mesh_sizes)`` dimensions of those sizes and names (row-major), one process
               group per new dimension (``backend_override`` by name or index; torch's ``"fake"`` backend
               for groups that never communicate). 2.4's DeviceMesh has neither layouts nor backend
               overrides.
Fix:           the same checks and errors as 2.15, then a new 2.4 DeviceMesh over ``self.mesh`` with
               ``dim`` unflattened and the names spliced in, whose every dimension gets its process
               groups from 2.4 (the default backend: a dimension 2.15 gives the fake backend gets real
               groups over the same ranks, which give the same results where anything communicates on
               them). The mesh is a root of its own: its slices (``mesh["fsdp"]``) and flattenings
               (device-mesh-flatten) are 2.4's. Not served: a data-parallel and a tensor-parallel mesh
               sliced from two different unflattenings are not one mesh's submeshes, so FSDP2 over TP
               parameters refuses them (2.4's ``FSDP requires the DP and TP mesh to have the same parent
               mesh``).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/device_mesh.py
"""

import math
from types import ModuleType
from typing import Any, Dict, Optional, Tuple, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="device-mesh-unflatten-24",
    summary="DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names, backend_override) on torch 2.4 "
    "(torchtitan 0.2.2 builds its meshes with it; every dimension gets real groups)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/device_mesh.py",
)
PATCH.sets("torch.distributed.device_mesh.DeviceMesh", ("_unflatten",))


def _unflatten(self: Any, dim: Union[int, str], mesh_sizes: Tuple[int, ...], mesh_dim_names: Tuple[str, ...],
               backend_override: Optional[Dict[Union[int, str], Any]] = None) -> Any:
    """``self`` with dimension ``dim`` unflattened into ``mesh_sizes`` named ``mesh_dim_names``."""
    from torch.distributed.device_mesh import DeviceMesh

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
    for key in backend_override or {}:
        if not (key in mesh_dim_names or (isinstance(key, int) and -len(mesh_sizes) <= key < len(mesh_sizes))):
            raise AssertionError(f"Found redundant dim index {key} in backend_override")
    dim_names = list(names) if names else [f"dim_{i}" for i in range(self.ndim)]
    dim_names[dim:dim + 1] = list(mesh_dim_names)
    return DeviceMesh(self.device_type, self.mesh.unflatten(dim, tuple(mesh_sizes)), mesh_dim_names=tuple(dim_names))


@PATCH.on_import("torch.distributed.device_mesh")
def add_unflatten(patcher: Patcher, device_mesh: ModuleType) -> Optional[bool]:
    mesh_class = getattr(device_mesh, "DeviceMesh", None)
    if mesh_class is None or hasattr(mesh_class, "_unflatten"):
        return False
    patcher.setattr(mesh_class, "_unflatten", _unflatten)
    return True

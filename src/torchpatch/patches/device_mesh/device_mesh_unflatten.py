"""device-mesh-unflatten: ``DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names, backend_override=None)``
on torch 2.9.

What breaks:   torchtitan 0.3.0 builds every mesh by unflattening its 1-D world mesh
               (``world_mesh._unflatten(0, (pp, batch, cp, tp), ("pp", "batch", "cp", "tp"),
               backend_override={...: "fake"})``), so on torch 2.9 nothing trains: ``AttributeError:
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
               Unlike 2.15 it is a root mesh of its own: its other dimensions get new process groups too
               (same ranks, so the same results), and a submesh of it is flattened in it, not in the
               mesh it was unflattened from.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/device_mesh.py
"""

import math
from types import ModuleType
from typing import Any, Dict, Optional, Tuple, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="device-mesh-unflatten",
    summary="DeviceMesh._unflatten(dim, mesh_sizes, mesh_dim_names, backend_override) on torch 2.9 "
    "(torchtitan 0.3.0 builds its meshes with it)",
    torch=">=2.9,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/device_mesh.py",
)
PATCH.sets("torch.distributed.device_mesh.DeviceMesh", ("_unflatten",))


def _register_fake_backend() -> None:
    import torch.distributed as dist

    if "fake" not in dist.Backend.backend_list:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend


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
    overrides = ((None, None),) * len(mesh_sizes)
    if backend_override is not None:
        overrides = tuple(device_mesh._normalize_backend_override(
            dict(backend_override), len(mesh_sizes), tuple(mesh_dim_names)))
        if any(backend == "fake" for backend, _ in overrides):
            _register_fake_backend()
    all_overrides = ((None, None),) * dim + overrides + ((None, None),) * (self.ndim - dim - 1)
    dim_names = list(names) if names else [f"dim_{i}" for i in range(self.ndim)]
    dim_names[dim:dim + 1] = list(mesh_dim_names)
    return device_mesh.DeviceMesh(self.device_type, self.mesh.unflatten(dim, tuple(mesh_sizes)),
                                  mesh_dim_names=tuple(dim_names), backend_override=all_overrides)


@PATCH.on_import("torch.distributed.device_mesh")
def add_unflatten(patcher: Patcher, device_mesh: ModuleType) -> Optional[bool]:
    mesh_class = getattr(device_mesh, "DeviceMesh", None)
    if mesh_class is None or hasattr(mesh_class, "_unflatten"):
        return False
    patcher.setattr(mesh_class, "_unflatten", _unflatten)
    return True

"""device-mesh-ordered-slice: slicing a ``DeviceMesh`` by names that skip a dimension
(``mesh["dp", "tp"]`` of a ``("dp", "cp", "tp")`` mesh) on torch 2.4.

What breaks:   torchtitan 0.3 slices its forward/backward mesh ``("dp", "cp", "tp")`` by the
               dimensions it uses; with ``cp`` 1, FSDP + TP asks for ``mesh["dp", "tp"]`` and torch
               2.4 refuses: ``KeyError: "Invalid mesh_dim_name ('dp', 'tp') specified. Valid
               mesh_dim_names should be a contiguous subsequence of ('dp', 'cp', 'tp')."``
Torch:         2.4 accepts only contiguous runs of names; torch 2.5 accepts any names in the mesh's
               order (pytorch#132310, then pytorch#133193 refused names out of order).
Fix:           names of the mesh's own dimensions, each once, in the mesh's order but not contiguous,
               give the submesh over those dimensions that torch 2.4's own slicing machinery builds
               (``_mesh_resources.create_child_mesh``: the same ranks, the dimensions' existing groups,
               the mesh recorded as its parent), as torch 2.5 does. Names out of order raise torch
               2.5's ``KeyError`` (ascending order); everything else is torch 2.4's ``__getitem__``.
Upstream:      https://github.com/pytorch/pytorch/pull/132310
"""

from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

from .._source import torch_source

PATCH = Patch(
    id="device-mesh-ordered-slice",
    summary="DeviceMesh slicing by names in the mesh's order that skip a dimension (mesh['dp', 'tp'] of ('dp', 'cp', 'tp'))",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/132310",
    behaviour="mesh['dp', 'tp'] of a ('dp', 'cp', 'tp') mesh",
    errors=(
        Error(r"Valid mesh_dim_names should be a contiguous subsequence of",
              "KeyError: \"Invalid mesh_dim_name ('dp', 'tp') specified. Valid mesh_dim_names should be a "
              "contiguous subsequence of ('dp', 'cp', 'tp').\""),
    ),
)

_CONTIGUOUS_ONLY = "should be a contiguous subsequence of"  # torch 2.4's __getitem__ refusal


def _getitem(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    names = args[0] if args else kwargs["mesh_dim_names"]
    names = (names,) if isinstance(names, str) else tuple(names)
    own = tuple(instance.mesh_dim_names or ())
    if len(names) < 2 or len(set(names)) != len(names) or not all(n in own for n in names):
        return wrapped(*args, **kwargs)
    dims = [own.index(n) for n in names]
    if dims == list(range(dims[0], dims[0] + len(dims))):
        return wrapped(*args, **kwargs)  # contiguous: torch 2.4's own
    if dims != sorted(dims):
        raise KeyError(f"Invalid mesh_dim_names {names} specified. Found mesh dim indices to slice: "
                       f"{[(d,) for d in dims]}. Mesh dim indices should be in ascending order.")
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.create_child_mesh(instance, names)


@PATCH.on_import("torch.distributed.device_mesh")
def slice_in_order(patcher: Patcher, device_mesh: Any) -> bool:
    if not hasattr(device_mesh, "DeviceMesh") or _CONTIGUOUS_ONLY not in torch_source(device_mesh):
        return False  # torch 2.5+ slices in order; or no DeviceMesh in this build
    patcher.wrap(device_mesh.DeviceMesh, "__getitem__", _getitem)
    return True

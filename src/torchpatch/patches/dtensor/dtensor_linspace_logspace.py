"""dtensor-linspace-logspace: the DTensor factories ``linspace`` and ``logspace`` of
``torch.distributed.tensor``, torch 2.4-2.13.

What breaks:   code written for torch >= 2.14 does ``from torch.distributed.tensor import linspace``
               (or ``logspace``) and dies with ``ImportError: cannot import name 'linspace' from
               'torch.distributed.tensor'``.
Torch:         2.4-2.13 have the other DTensor factories (``zeros``, ``full``, ``rand``, ...; on 2.4
               in the private ``torch.distributed._tensor``, served publicly by dtensor-public) and
               the helper that builds them, but not these two; they came with 2.14.
Fix:           serve both with torch 2.14's signatures and semantics: ``linspace(start, end,
               steps, *, dtype=None, layout=torch.strided, requires_grad=False, device_mesh=None,
               placements=None)`` and ``logspace(start, end, steps, base=10.0, *, ...)`` make a 1-D
               DTensor of ``steps`` points on the mesh's device (default: the current mesh,
               ``Replicate()`` on each of its dimensions) whose global tensor is
               ``torch.linspace``/``torch.logspace`` of the same arguments: each rank computes only
               its own shard, the points from its global offset on (``compute_local_shape_and_global_offset``),
               through this torch's own factory helper (``_dtensor_init_helper``), which builds
               the DTensor, its spec and ``requires_grad`` as for ``zeros``. ``start``/``end`` may
               be 0-dimensional tensors (their values are taken, as torch does); other tensors,
               ``_StridedShard`` placements and non-strided layouts raise torch's errors.
Upstream:      https://github.com/pytorch/pytorch/pull/187933 (``linspace``);
               https://github.com/pytorch/pytorch/pull/186398 (``logspace``)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from torchpatch import Error, Patch

PATCH = Patch(
    id="dtensor-linspace-logspace",
    summary="torch.distributed.tensor.linspace and logspace (DTensor factories of torch 2.14)",
    torch=">=2.4,<2.14",
    upstream="https://github.com/pytorch/pytorch/pull/187933",
    errors=(
        Error(r'Operator aten\.(?:linspace|logspace)\.\w+ does not have a sharding strategy registered',
              "NotImplementedError: Operator aten.linspace.default does not have a sharding strategy registered."),
    ),
)


def _torch_helpers() -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """This torch's ``_dtensor_init_helper`` and ``compute_local_shape_and_global_offset``."""
    try:
        from torch.distributed.tensor._api import _dtensor_init_helper
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4: DTensor is still torch.distributed._tensor
        from torch.distributed._tensor import _dtensor_init_helper
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    return _dtensor_init_helper, compute_local_shape_and_global_offset


def _scalar(value: Any, name: str) -> Any:
    """``value``, or the value of a 0-dimensional tensor (torch's eager factories take its item)."""
    import torch

    if isinstance(value, torch.Tensor):
        torch._check(value.dim() == 0, lambda: f"{name} only supports 0-dimensional start and end tensors")
        return value.item()
    return value


def _spaced(op: Callable[..., Any], name: str, start: Any, end: Any, steps: int, op_kwargs: Dict[str, Any],
            dtype: Any, layout: Any, requires_grad: bool, device_mesh: Any,
            placements: Optional[Sequence[Any]]) -> Any:
    """The DTensor whose global tensor is ``op(start, end, steps, **op_kwargs)``: each rank makes its
    shard, ``op`` from the point at its global offset over its own number of points."""
    import torch

    if placements is not None and any(type(p).__name__ == "_StridedShard" for p in placements):
        raise AssertionError(f"{name} does not support _StridedShard placements")
    start, end = _scalar(start, name), _scalar(end, name)
    size = torch.Size((steps,))
    init_helper, local_shape_and_offset = _torch_helpers()
    mesh = device_mesh or _mesh_resources().get_current_mesh()
    placements = placements or [_replicate()] * mesh.ndim

    def local_points(local_shape: Sequence[int], **kwargs: Any) -> torch.Tensor:
        count = local_shape[0] if len(local_shape) else 0  # () on a rank outside the mesh
        first, last = start, end
        if count > 0 and steps > 1:
            step = (end - start) / (steps - 1)
            first = start + local_shape_and_offset(size, mesh, placements)[1][0] * step
            last = first + step * (count - 1)
        elif count > 0:
            last = start
        return op(first, last, steps=count, **op_kwargs, **kwargs)

    # The helper checks the placements and layout, then calls local_points with this rank's shape.
    return init_helper(local_points, size, device_mesh=mesh, placements=placements, dtype=dtype,
                       layout=layout, requires_grad=requires_grad)


def _mesh_resources() -> Any:
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources


def _replicate() -> Any:
    try:
        from torch.distributed.tensor.placement_types import Replicate
    except ImportError:  # torch 2.4 without torchpatch's relocations
        from torch.distributed._tensor.placement_types import Replicate
    return Replicate()


def linspace(start: Any, end: Any, steps: int, *, dtype: Any = None, layout: Any = None,
             requires_grad: bool = False, device_mesh: Any = None, placements: Optional[Sequence[Any]] = None) -> Any:
    """A 1-D DTensor of ``steps`` points evenly spaced from ``start`` to ``end`` (torch 2.14's
    ``torch.distributed.tensor.linspace``, served by torchpatch)."""
    import torch

    return _spaced(torch.linspace, "linspace", start, end, steps, {}, dtype, layout or torch.strided,
                   requires_grad, device_mesh, placements)


def logspace(start: Any, end: Any, steps: int, base: float = 10.0, *, dtype: Any = None, layout: Any = None,
             requires_grad: bool = False, device_mesh: Any = None, placements: Optional[Sequence[Any]] = None) -> Any:
    """A 1-D DTensor of ``steps`` points from ``base ** start`` to ``base ** end``, evenly spaced on a
    logarithmic scale (torch 2.14's ``torch.distributed.tensor.logspace``, served by torchpatch)."""
    import torch

    return _spaced(torch.logspace, "logspace", start, end, steps, {"base": base}, dtype,
                   layout or torch.strided, requires_grad, device_mesh, placements)


PATCH.symbol("torch.distributed.tensor", "linspace")(lambda: linspace)
PATCH.symbol("torch.distributed.tensor", "logspace")(lambda: logspace)

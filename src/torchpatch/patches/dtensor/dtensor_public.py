"""dtensor-public: the public DTensor API (``torch.distributed.tensor``), torch 2.1-2.4.

What breaks:   code written for torch >= 2.5 (transformers, torchtitan, accelerate) does
               ``from torch.distributed.tensor import DTensor, Shard, distribute_tensor`` and dies
               with ``ImportError: cannot import name 'DTensor' from 'torch.distributed.tensor'``;
               on 2.1 also ``from torch.distributed.device_mesh import init_device_mesh``
               (``ModuleNotFoundError: No module named 'torch.distributed.device_mesh'``) and
               ``dtensor.full_tensor()`` (``AttributeError: 'DTensor' object has no attribute
               'full_tensor'``).
Torch:         2.1–2.4 keep DTensor in the private ``torch.distributed._tensor``;
               ``torch.distributed.tensor`` only holds ``parallel``. 2.1 has DeviceMesh only as
               ``torch.distributed._tensor.device_mesh`` (2.2 added ``torch.distributed.device_mesh``)
               and no ``DTensor.full_tensor`` (added in 2.2), nor ``randn`` (added in 2.3).
               1.13 has no DTensor at all: nothing is served there.
Fix:           serve ``DTensor``, ``distribute_tensor``, ``distribute_module``, ``Shard``,
               ``Replicate``, ``Placement``, ``DeviceMesh``, ``init_device_mesh`` and the factories
               ``zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn`` on the existing
               ``torch.distributed.tensor`` package, as the very objects of
               ``torch.distributed._tensor`` (``Partial`` comes from dtensor-partial). Where 2.1
               lacks them: ``torch.distributed.device_mesh`` is the module
               ``torch.distributed._tensor.device_mesh`` (same ``DeviceMesh``/``init_device_mesh``;
               only the private constructor flag is ``_init_process_groups`` there, not
               ``_init_backend``); ``DTensor.full_tensor(*, grad_placements=None)`` redistributes
               to ``Replicate`` on every mesh dimension and returns the local tensor, waited for
               and differentiable, as torch >= 2.2 does; ``randn`` is 2.1's ``rand`` with normal
               samples, drawn in DTensor's RNG region, which on 2.1 (as for 2.1's own ``rand``)
               needs a CUDA-like device mesh: on a CPU mesh it raises a ``RuntimeError`` saying so.
Upstream:      https://github.com/pytorch/pytorch/pull/133881 (DTensor public, torch 2.5);
               https://github.com/pytorch/pytorch/pull/112224 (``full_tensor``, torch 2.2);
               https://github.com/pytorch/pytorch/pull/112364 (DeviceMesh out of ``_tensor``)
"""

import functools
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dtensor-public",
    summary="torch.distributed.tensor public DTensor API (DTensor, Shard, distribute_tensor, ...), "
    "torch.distributed.device_mesh and DTensor.full_tensor",
    torch=">=2.1,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/133881",
    behaviour="DTensor.full_tensor where torch lacks it",
)

PUBLIC = ("DTensor", "distribute_tensor", "distribute_module", "Shard", "Replicate", "Placement",
          "DeviceMesh", "init_device_mesh", "zeros", "ones", "empty", "full", "rand", "randn")


def _from_private(name: str) -> Callable[[], Any]:
    def factory() -> Any:
        import torch.distributed._tensor as dtensor

        if name == "randn" and not hasattr(dtensor, "randn"):
            return randn
        return getattr(dtensor, name)

    return factory


for _name in PUBLIC:
    PATCH.symbol("torch.distributed.tensor", _name)(_from_private(_name))

PATCH.alias("torch.distributed.device_mesh", "torch.distributed._tensor.device_mesh")


def randn(*size: Any, requires_grad: bool = False, dtype: Any = None, layout: Any = None,
          device_mesh: Any = None, placements: Optional[Sequence[Any]] = None) -> Any:
    """A DTensor of normal samples (torch >= 2.3's ``randn``), made the way 2.1 makes ``rand``."""
    import torch
    import torch.distributed._tensor as dtensor
    from torch.distributed._tensor import random
    from torch.distributed._tensor._utils import compute_local_shape
    from torch.distributed._tensor.placement_types import DTensorSpec, Replicate
    from torch.fx.passes.shape_prop import TensorMetadata

    shape = dtensor._normalize_to_torch_size(size)
    mesh = device_mesh or dtensor.mesh_resources.get_current_mesh()
    placements = tuple(placements or [Replicate()] * mesh.ndim)
    if len(placements) != mesh.ndim:
        raise ValueError(f"randn: {len(placements)} placements for a {mesh.ndim}-dimensional device mesh")
    if layout not in (None, torch.strided):
        raise ValueError(f"randn: only the strided layout is supported, not {layout}")
    dtype = dtype or torch.get_default_dtype()
    if random.is_rng_supported_mesh(mesh) and not random._rng_tracker:
        random._rng_tracker = random.OffsetBasedRNGTracker(mesh.device_type)
    if random._rng_tracker is None:
        raise RuntimeError(
            f"DTensor randn on torch {torch.__version__} (served by torchpatch) draws in DTensor's RNG "
            f"region, which this torch only has for CUDA-like device meshes, not {mesh.device_type!r} "
            f"(torch.distributed._tensor.rand has the same limit here)"
        )
    local_shape = compute_local_shape(shape, mesh, placements)
    if len(local_shape) == 0:  # this rank is not in the mesh: an empty local tensor, as 2.1's rand
        local = torch.empty(0, dtype=dtype, device=mesh.device_type, requires_grad=requires_grad)
    else:
        meta = TensorMetadata(shape, dtype, requires_grad, (0,), None, False, {})
        with random._rng_tracker._distribute_region(DTensorSpec(mesh, placements, tensor_meta=meta)):
            local = torch.randn(local_shape, dtype=dtype, device=mesh.device_type, requires_grad=requires_grad)
    return dtensor.DTensor(
        local, mesh, placements, shape=shape, dtype=local.dtype, requires_grad=requires_grad,
        stride=torch._prims_common.make_contiguous_strides_for(shape),
    )


@functools.lru_cache(maxsize=None)
def _to_local_waited() -> Any:
    """``DTensor.to_local`` that waits for the collective behind the local tensor, and whose
    gradient may be laid out as ``grad_placements`` (torch >= 2.2's ``_ToTorchTensor``)."""
    import torch
    import torch.distributed._functional_collectives as funcol
    from torch.distributed._tensor._utils import compute_global_tensor_info
    from torch.distributed._tensor.api import DTensor

    class ToLocalWaited(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, dt: Any, grad_placements: Optional[Sequence[Any]]) -> torch.Tensor:  # type: ignore[override]
            ctx.spec, ctx.grad_placements = dt._spec, grad_placements
            local = dt._local_tensor
            if isinstance(local, funcol.AsyncCollectiveTensor):
                local = funcol.wait_tensor(local)  # a plain tensor, as full_tensor gives on 2.2+
            return local.view_as(local)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
            spec = ctx.spec
            placements = tuple(ctx.grad_placements or spec.placements)
            _, stride = compute_global_tensor_info(grad, spec.mesh, placements)
            out = DTensor(grad, spec.mesh, placements, shape=spec.tensor_meta.shape,
                          dtype=spec.tensor_meta.dtype, requires_grad=grad.requires_grad, stride=tuple(stride))
            return out, None

    return ToLocalWaited


def full_tensor(self: Any, *, grad_placements: Optional[Sequence[Any]] = None) -> Any:
    """The whole tensor on every rank: redistribute to ``Replicate`` on every mesh dimension,
    then the local tensor (torch >= 2.2's ``DTensor.full_tensor``)."""
    from torch.distributed._tensor.placement_types import Replicate

    replicated = self.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
    return _to_local_waited().apply(replicated, grad_placements)


PATCH.sets("torch.distributed._tensor.api.DTensor", ("full_tensor",))  # a member: on the class's dotted name


@PATCH.on_import("torch.distributed._tensor.api")
def add_full_tensor(patcher: Patcher, api: ModuleType) -> bool:
    if hasattr(api.DTensor, "full_tensor"):
        return False
    patcher.setattr(api.DTensor, "full_tensor", full_tensor)
    return True

"""nn-utils-clip-grads: ``torch.nn.utils.get_total_norm`` and ``torch.nn.utils.clip_grads_with_norm_``
(gradient clipping in two steps), torch 1.13-2.5.

What breaks:   torchtitan (early 2025) clips gradients under pipeline parallelism by computing the
               norm of its local gradients, reducing it across stages, then scaling:
               ``total_norm = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)`` and
               ``torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, foreach)``.
               These calls sit inside a function, so imports succeed and the first training step
               dies with ``AttributeError: module 'torch.nn.utils' has no attribute
               'get_total_norm'``.
Torch:         1.13 to 2.5 have only ``clip_grad_norm_``, which does both steps at once; torch 2.6
               split it into these two functions. Nothing is served where torch has them.
Fix:           serve both with torch 2.13's semantics and numerics. ``get_total_norm(tensors,
               norm_type=2.0, error_if_nonfinite=False, foreach=None)`` takes the p-norm of each
               tensor and then the p-norm of those norms (``inf``: the largest absolute value), on
               the first tensor's device, without autograd; an empty list gives ``tensor(0.)``; a
               non-finite result raises with ``error_if_nonfinite``. ``clip_grads_with_norm_(
               parameters, max_norm, total_norm, foreach=None)`` multiplies every ``.grad`` in place
               by ``min(max_norm / (total_norm + 1e-6), 1)``, computed as a tensor (no
               device-to-host sync). Tensors are grouped by device and dtype; ``foreach=None`` uses
               torch's ``_foreach_norm`` / ``_foreach_mul_`` kernels for plain tensors on CPU, CUDA,
               XPU and the private-use device, ``foreach=True`` insists (a ``RuntimeError`` on other
               devices), ``foreach=False`` goes tensor by tensor; the results are the same. (torch 1.13's
               ``_foreach_mul_`` takes the coefficient as a number: there the foreach path reads
               it back from the device once per device and dtype.)
Upstream:      https://github.com/pytorch/pytorch/pull/139662 (the two functions, torch 2.6)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Tuple, Union

from torchpatch import Patch

if TYPE_CHECKING:  # annotations only: torch is never imported at this module's top level
    import torch

PATCH = Patch(
    id="nn-utils-clip-grads",
    summary="torch.nn.utils.get_total_norm and clip_grads_with_norm_ (torch 2.6's two-step gradient clipping)",
    torch="<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/139662",
)

TensorOrTensors = Union["torch.Tensor", Iterable["torch.Tensor"]]


def _device_has_foreach_support(device: "torch.device") -> bool:
    import torch

    devices = ["cuda", "xpu", "cpu"]
    private_use = getattr(torch._C, "_get_privateuse1_backend_name", None)
    if private_use is not None:
        devices.append(private_use())
    return device.type in devices and not torch.jit.is_scripting()


def _has_foreach_support(tensors: List["torch.Tensor"], device: "torch.device") -> bool:
    import torch

    return _device_has_foreach_support(device) and all(t is None or type(t) is torch.Tensor for t in tensors)


def _group_by_device_and_dtype(tensors: List["torch.Tensor"]) -> Dict[Tuple["torch.device", "torch.dtype"], List["torch.Tensor"]]:
    """torch's own grouping where it has one (2.1+), else the same in first-seen order."""
    try:
        from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
    except ImportError:
        groups: Dict[Tuple["torch.device", "torch.dtype"], List["torch.Tensor"]] = {}
        for t in tensors:
            groups.setdefault((t.device, t.dtype), []).append(t)
        return groups
    return {key: lists[0] for key, (lists, _) in _group_tensors_by_device_and_dtype([tensors]).items()}


def _use_foreach(foreach: Optional[bool], tensors: List["torch.Tensor"], device: "torch.device") -> bool:
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def get_total_norm(tensors: TensorOrTensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: Optional[bool] = None) -> "torch.Tensor":
    r"""Compute the norm of an iterable of tensors.

    The norm is computed over the norms of the individual tensors, as if the norms of
    the individual tensors were concatenated into a single vector.

    Args:
        tensors (Iterable[Tensor] or Tensor): an iterable of Tensors or a
            single Tensor that will be normalized
        norm_type (float): type of the used p-norm. Can be ``'inf'`` for
            infinity norm.
        error_if_nonfinite (bool): if True, an error is thrown if the total
            norm of :attr:`tensors` is ``nan``, ``inf``, or ``-inf``.
            Default: ``False``
        foreach (bool): use the faster foreach-based implementation.
            If ``None``, use the foreach implementation for CUDA and CPU native tensors and silently
            fall back to the slow implementation for other device types.
            Default: ``None``

    Returns:
        Total norm of the tensors (viewed as a single vector).
    """
    import torch

    with torch.no_grad():
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        norm_type = float(norm_type)
        if not tensors:
            return torch.tensor(0.0)
        first_device = tensors[0].device
        norms: List[torch.Tensor] = []
        for (device, _), group in _group_by_device_and_dtype(tensors).items():
            if _use_foreach(foreach, group, device):
                norms.extend(torch._foreach_norm(group, norm_type))
            else:
                norms.extend(torch.linalg.vector_norm(t, norm_type) for t in group)
        total_norm = torch.linalg.vector_norm(torch.stack([norm.to(first_device) for norm in norms]), norm_type)
        if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from "
                "`parameters` is non-finite, so it cannot be clipped. To disable "
                "this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`"
            )
        return total_norm


def clip_grads_with_norm_(parameters: TensorOrTensors, max_norm: float, total_norm: "torch.Tensor",
                          foreach: Optional[bool] = None) -> None:
    r"""Scale the gradients of an iterable of parameters given a pre-calculated total norm and desired max norm.

    The gradients will be scaled by the following calculation

    .. math::
        grad = grad * \min(\frac{max\_norm}{total\_norm + 1e-6}, 1)

    Gradients are modified in-place. This function is equivalent to
    :func:`torch.nn.utils.clip_grad_norm_` with a pre-calculated total norm.

    Args:
        parameters (Iterable[Tensor] or Tensor): an iterable of Tensors or a
            single Tensor that will have gradients normalized
        max_norm (float): max norm of the gradients
        total_norm (Tensor): total norm of the gradients to use for clipping
        foreach (bool): use the faster foreach-based implementation.
            If ``None``, use the foreach implementation for CUDA and CPU native tensors and silently
            fall back to the slow implementation for other device types.
            Default: ``None``
    """
    import torch

    with torch.no_grad():
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        grads = [p.grad for p in parameters if p.grad is not None]
        max_norm = float(max_norm)
        if not grads:
            return
        clip_coef_clamped = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for (device, _), group in _group_by_device_and_dtype(grads).items():
            if _use_foreach(foreach, group, device):
                torch._foreach_mul_(group, clip_coef_clamped.to(device))
            else:
                coef = clip_coef_clamped.to(device)
                for g in group:
                    g.mul_(coef)


@PATCH.symbol("torch.nn.utils", "get_total_norm")
def serve_get_total_norm() -> object:
    return get_total_norm


@PATCH.symbol("torch.nn.utils", "clip_grads_with_norm_")
def serve_clip_grads_with_norm() -> object:
    return clip_grads_with_norm_

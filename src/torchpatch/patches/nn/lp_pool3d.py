"""lp-pool3d: ``torch.nn.functional.lp_pool3d`` on torch 1.13.

What breaks:   code that power-average pools volumes (video, 3-D medical images) calls
               ``F.lp_pool3d(x, norm_type, kernel_size)`` and dies on torch 1.13 with
               ``AttributeError: module 'torch.nn.functional' has no attribute 'lp_pool3d'``.
Torch:         2.1 added it next to ``lp_pool1d``/``lp_pool2d``; 1.13 has the 3-D average and max
               pooling it is made of.
Fix:           serve it as torch 2.15 computes it: ``(sign(s) * relu(|s|) * kD*kH*kW) ** (1/p)`` with
               ``s = avg_pool3d(x ** p)`` (so gradients are autograd's through those operations),
               ``max_pool3d`` of ``|x|`` for ``p = inf`` and its negated minimum for ``p = -inf``, and
               torch's ``ValueError`` for ``p = 0``; a ``__torch_function__`` of ``x`` is honoured.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/nn/functional.py (``lp_pool3d``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from torchpatch import Patch

if TYPE_CHECKING:  # annotations only: torch is never imported at this module's top level
    import torch

PATCH = Patch(
    id="lp-pool3d",
    summary="torch.nn.functional.lp_pool3d (power-average 3-D pooling) on torch 1.13",
    torch="<2.1",
    upstream="https://github.com/pytorch/pytorch/blob/v2.15.0/torch/nn/functional.py",
)


def lp_pool3d(input: "torch.Tensor", norm_type: Union[int, float], kernel_size: Any, stride: Optional[Any] = None,
              ceil_mode: bool = False) -> "torch.Tensor":
    """3-D power-average pooling: the ``norm_type``-norm of each window."""
    import torch
    from torch.nn import functional as F
    from torch.nn.modules.utils import _triple
    from torch.overrides import handle_torch_function, has_torch_function_unary

    if has_torch_function_unary(input):
        return handle_torch_function(lp_pool3d, (input,), input, norm_type, kernel_size, stride=stride,
                                     ceil_mode=ceil_mode)
    kd, kw, kh = _triple(kernel_size)
    if isinstance(norm_type, (int, float)):
        if norm_type == 0:
            raise ValueError(f"norm_type must be a non-zero value, but got {norm_type}")
        if norm_type == float("inf"):
            return F.max_pool3d(input.abs(), kernel_size, stride, 0, 1, ceil_mode)
        if norm_type == -float("inf"):
            return -F.max_pool3d(-input.abs(), kernel_size, stride, 0, 1, ceil_mode)
    if stride is not None:
        out = F.avg_pool3d(input.pow(norm_type), kernel_size, stride, 0, ceil_mode)
    else:
        out = F.avg_pool3d(input.pow(norm_type), kernel_size, padding=0, ceil_mode=ceil_mode)
    return (torch.sign(out) * F.relu(torch.abs(out))).mul(kd * kw * kh).pow(1.0 / norm_type)


PATCH.symbol("torch.nn.functional", "lp_pool3d")(lambda: lp_pool3d)

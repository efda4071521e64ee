"""nn-functional-helpers: ``torch.nn.functional.lp_pool3d`` and the private argument helpers of torch 2's
``torch.nn.functional`` (``_canonical_mask``, ``_none_or_dtype``, ...), torch 1.13-2.0.

What breaks:   code that power-average pools volumes (video, 3-D medical images) calls
               ``F.lp_pool3d(x, norm_type, kernel_size)``, and attention layers adapted from torch 2's
               ``MultiheadAttention`` import its mask helpers (``from torch.nn.functional import
               _canonical_mask, _none_or_dtype``); on torch 1.13 they die with ``AttributeError``/
               ``ImportError`` naming the function.
Torch:         2.0-2.1 added them; 1.13 has the 3-D average and max pooling ``lp_pool3d`` is made of,
               and the helpers need nothing but tensors' dtypes and shapes.
Fix:           serve ``lp_pool3d`` as torch 2.15 computes it: ``(sign(s) * relu(|s|) * kD*kH*kW) ** (1/p)`` with
               ``s = avg_pool3d(x ** p)`` (so gradients are autograd's through those operations),
               ``max_pool3d`` of ``|x|`` for ``p = inf`` and its negated minimum for ``p = -inf``, and
               torch's ``ValueError`` for ``p = 0``; a ``__torch_function__`` of ``x`` is honoured. The
               helpers as torch 2.15 has them: ``_canonical_mask`` turns a bool mask into a float one
               (-inf where True; torch's ``AssertionError`` for other dtypes, its warning when the other
               mask's dtype differs), ``_none_or_dtype``, ``_check_key_padding_mask`` (shape, as
               ``AssertionError``), ``_check_unpool_output_size`` (``ValueError``), ``_is_integer``
               (an int, a numpy integer, or a tensor that is not floating point), ``_expand_single_value``,
               ``_list_or_empty``, ``_enum_list_as_int_list``.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/nn/functional.py (``lp_pool3d``)
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, List, Optional, Union

from torchpatch import Patch
from torchpatch.patches.core.torch_toplevel_helpers import _check_value, _check_with

if TYPE_CHECKING:  # annotations only: torch is never imported at this module's top level
    import torch

PATCH = Patch(
    id="nn-functional-helpers",
    summary="torch.nn.functional.lp_pool3d and torch 2's private argument helpers (_canonical_mask, "
            "_none_or_dtype, ...)",
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


def _canonical_mask(mask: Optional["torch.Tensor"], mask_name: str, other_type: Optional["torch.dtype"],
                    other_name: str, target_type: "torch.dtype", check_other: bool = True) -> Optional["torch.Tensor"]:
    """``mask`` as an additive float mask of ``target_type`` (a bool mask: -inf where True)."""
    import torch

    if mask is not None:
        is_float = torch.is_floating_point(mask)
        if mask.dtype != torch.bool and not is_float:
            raise AssertionError(f"only bool and floating types of {mask_name} are supported")
        if check_other and other_type is not None and mask.dtype != other_type:
            warnings.warn(f"Support for mismatched {mask_name} and {other_name} is deprecated. Use same type for both "
                          "instead.", stacklevel=2)
        if not is_float:
            mask = torch.zeros_like(mask, dtype=target_type).masked_fill_(mask, float("-inf"))
    return mask


def _none_or_dtype(input: Optional["torch.Tensor"]) -> Optional["torch.dtype"]:
    import torch

    if input is None:
        return None
    if isinstance(input, torch.Tensor):
        return input.dtype
    raise RuntimeError("input to _none_or_dtype() must be None or torch.Tensor")


def _check_key_padding_mask(key_padding_mask: "torch.Tensor", src_len: int, bsz: int) -> None:
    _check_with(AssertionError, key_padding_mask.shape[0] == bsz,
                lambda: f"Expected key_padded_mask.shape[0] to be {bsz}, but got {key_padding_mask.shape[0]}")
    _check_with(AssertionError, key_padding_mask.shape[1] == src_len,
                lambda: f"Expected key_padded_mask.shape[1] to be {src_len}, but got {key_padding_mask.shape[1]}")


def _check_unpool_output_size(output_size: List[int], dim: int) -> None:
    _check_value(output_size[dim] >= 0,
                 lambda: ("max_unpooling: output_size must contain non-negative spatial "
                          f"dimensions, but got output_size[{dim}]={output_size[dim]}"))


def _is_integer(x: Any) -> bool:
    """An int, a numpy integer, or a tensor that is not floating point."""
    import torch

    if isinstance(x, int):
        return True
    try:
        import numpy as np
    except ModuleNotFoundError:
        np = None
    if np is not None and isinstance(x, np.integer):
        return True
    return isinstance(x, torch.Tensor) and not x.is_floating_point()


def _expand_single_value(v: Any) -> List[Any]:
    return [] if v is None else v if isinstance(v, list) else [v]


def _list_or_empty(values: Optional[List[Any]]) -> List[Any]:
    return values if values else []


def _enum_list_as_int_list(values: Any) -> List[Any]:
    return [item.value for item in (values if isinstance(values, list) else [values])]


for _function in (lp_pool3d, _canonical_mask, _none_or_dtype, _check_key_padding_mask, _check_unpool_output_size,
                  _is_integer, _expand_single_value, _list_or_empty, _enum_list_as_int_list):
    PATCH.symbol("torch.nn.functional", _function.__name__)(lambda _function=_function: _function)

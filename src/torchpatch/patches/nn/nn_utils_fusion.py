"""nn-utils-fusion: ``torch.nn.utils.fuse_linear_bn_eval``, ``fuse_linear_bn_weights`` and
``convert_conv3d_weight_memory_format``, torch 1.13-2.3.

What breaks:   inference code that folds a BatchNorm into the Linear before it
               (``torch.nn.utils.fuse_linear_bn_eval(linear, bn)``), or turns 3-D convolution weights
               channels-last (``torch.nn.utils.convert_conv3d_weight_memory_format(model,
               torch.channels_last_3d)``), dies with ``AttributeError: module 'torch.nn.utils' has
               no attribute ...``.
Torch:         1.13-2.3 have the fusion functions only in ``torch.nn.utils.fusion``, where they keep
               neither the Linear's dtype nor its parameters' ``requires_grad``, and have no Conv3d
               counterpart of ``convert_conv2d_weight_memory_format``; 2.4 exports all three.
Fix:           serve them with torch 2.15's semantics: the fused weight and bias keep the Linear's
               dtypes and ``requires_grad``; a Linear without bias gets a zero one; the modules must
               be in eval mode, the BatchNorm's features equal the Linear's outputs (or be 1) and its
               running statistics exist, else torch's ``AssertionError``. The Conv3d conversion clones
               each ``Conv3d``/``ConvTranspose3d`` weight into ``memory_format``, recursively.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/nn/utils/fusion.py;
               https://github.com/pytorch/pytorch/blob/v2.15.0/torch/nn/utils/memory_format.py
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional, Tuple

from torchpatch import Patch

if TYPE_CHECKING:  # annotations only: torch is never imported at this module's top level
    import torch

PATCH = Patch(
    id="nn-utils-fusion",
    summary="torch.nn.utils.fuse_linear_bn_eval/fuse_linear_bn_weights (torch 2.15's dtypes and requires_grad) "
            "and convert_conv3d_weight_memory_format",
    torch="<2.4",
    upstream="https://github.com/pytorch/pytorch/blob/v2.15.0/torch/nn/utils/fusion.py",
)

MODULE = "torch.nn.utils"


def fuse_linear_bn_weights(linear_w: "torch.Tensor", linear_b: Optional["torch.Tensor"], bn_rm: "torch.Tensor",
                           bn_rv: "torch.Tensor", bn_eps: float, bn_w: "torch.Tensor",
                           bn_b: "torch.Tensor") -> Tuple["torch.nn.Parameter", "torch.nn.Parameter"]:
    """The weight and bias of a Linear followed by a BatchNorm in eval mode, as one Linear's."""
    import torch

    weight_dtype = linear_w.dtype
    bias_dtype = linear_b.dtype if linear_b is not None else weight_dtype
    if linear_b is None:
        linear_b = torch.zeros_like(bn_rm)
    bn_scale = bn_w * torch.rsqrt(bn_rv + bn_eps)
    fused_w = linear_w * bn_scale.unsqueeze(-1).to(dtype=weight_dtype)
    fused_b = ((linear_b - bn_rm) * bn_scale + bn_b).to(dtype=bias_dtype)
    return torch.nn.Parameter(fused_w, linear_w.requires_grad), torch.nn.Parameter(fused_b, linear_b.requires_grad)


def fuse_linear_bn_eval(linear: Any, bn: Any) -> Any:
    """A new Linear computing ``bn(linear(x))`` (both in eval mode)."""
    if linear.training or bn.training:
        raise AssertionError("Fusion only for eval!")
    fused = copy.deepcopy(linear)
    if linear.out_features != bn.num_features and bn.num_features != 1:
        raise AssertionError(
            f"To fuse, linear.out_features == bn.num_features or bn.num_features == 1, "
            f"got linear.out_features={linear.out_features} and bn.num_features={bn.num_features}")
    if bn.running_mean is None or bn.running_var is None:
        raise AssertionError("bn.running_mean and bn.running_var must not be None")
    fused.weight, fused.bias = fuse_linear_bn_weights(fused.weight, fused.bias, bn.running_mean, bn.running_var,
                                                      bn.eps, bn.weight, bn.bias)
    return fused


def convert_conv3d_weight_memory_format(module: Any, memory_format: "torch.memory_format") -> Any:
    """``module`` with each Conv3d/ConvTranspose3d weight in it (itself included) in ``memory_format``."""
    import torch

    if isinstance(module, (torch.nn.Conv3d, torch.nn.ConvTranspose3d)):
        weight = module.weight.detach().clone(memory_format=memory_format)
        module.weight.data = weight.resize_(weight.size(), memory_format=memory_format)
    for child in module.children():
        convert_conv3d_weight_memory_format(child, memory_format)
    return module


for _function in (fuse_linear_bn_eval, fuse_linear_bn_weights, convert_conv3d_weight_memory_format):
    PATCH.symbol(MODULE, _function.__name__)(lambda _function=_function: _function)

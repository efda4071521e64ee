"""sdpa-backport: ``torch.nn.attention`` (``sdpa_kernel``, ``SDPBackend``), and on torch 1.13
``torch.nn.functional.scaled_dot_product_attention``, torch 1.13-2.2.

What breaks:   - DiT-style models (OpenDiT, Open-Sora, torchtitan's attention) call
                 ``F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...)`` in
                 ``forward``; on torch 1.13 the first forward pass dies with
                 ``AttributeError: module 'torch.nn.functional' has no attribute
                 'scaled_dot_product_attention'``.
               - code selecting attention kernels does
                 ``from torch.nn.attention import SDPBackend, sdpa_kernel`` and
                 ``with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]): ...``; on torch
                 1.13 and 2.1 that is ``ModuleNotFoundError: No module named 'torch.nn.attention'``.
Torch:         SDPA came with torch 2.0, ``torch.nn.attention`` with 2.3 (2.0 to 2.2 select kernels
               with ``torch.backends.cuda.sdp_kernel(enable_flash=..., enable_math=...,
               enable_mem_efficient=...)``; 1.13 has that context manager too, with flash and math
               flags only). Nothing is served where torch has it.
Fix:           - torch 1.13: ``scaled_dot_product_attention(query, key, value, attn_mask=None,
                 dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False)`` computed the way
                 torch 2.13's math backend does, step for step (bit for bit on torch 2.13): q and k
                 each scaled by the square root of ``scale`` (default ``1/sqrt(E)``; a negative
                 scale negates q), half and bfloat16 computed in float32 and cast back, a boolean
                 mask (True = attend) turned into 0/-inf, ``is_causal`` the lower-left triangle
                 (with an explicit mask it is an error), ``enable_gqa`` repeating key/value heads,
                 softmax where a row masked entirely gives zeros (not NaN), ``torch.dropout`` of the
                 weights when ``dropout_p > 0`` (always, as in torch: SDPA has no training flag),
                 differentiable. Invalid inputs raise torch's errors. It is the only kernel here: it
                 runs whatever ``sdpa_kernel`` selects unless every backend is disabled, then it
                 raises as torch 2.x does (torch 2.1 on CPU likewise runs math whenever any flag is
                 on). The function is set on ``torch.nn.functional`` as a plain attribute (1.13's
                 module has no ``__getattr__``, and adding one slows every ``F.x`` lookup).
               - torch 1.13 to 2.2: a ``torch.nn.attention`` module with ``SDPBackend`` (torch's own
                 ``torch.backends.cuda.SDPBackend`` where it exists, on 1.13 an ``IntEnum`` with the
                 same members and values: ``ERROR``, ``MATH``, ``FLASH_ATTENTION``,
                 ``EFFICIENT_ATTENTION``) and ``sdpa_kernel(backends, set_priority=False)``, which
                 enables exactly the given backends through the ``torch.backends.cuda`` flags that
                 ``sdp_kernel`` sets, yields ``{}`` and restores the previous flags on exit.
                 Backends newer than the installed torch (``CUDNN_ATTENTION``, ``OVERRIDEABLE``) are
                 missing from its enum, hence ``AttributeError``; ``set_priority=True`` needs the
                 backend priority order of a newer torch (2.4 has none, 2.9 has it) and raises
                 ``NotImplementedError``.
Upstream:      https://pytorch.org/docs/2.0/generated/torch.nn.functional.scaled_dot_product_attention.html
               (SDPA, torch 2.0); https://pytorch.org/docs/2.3/generated/torch.nn.attention.sdpa_kernel.html
               (``torch.nn.attention.sdpa_kernel``, torch 2.3)
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
from types import ModuleType
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Union

from torchpatch import Patch, Patcher

if TYPE_CHECKING:  # annotations only: torch is never imported at this module's top level
    import torch

PATCH = Patch(
    id="sdpa-backport",
    summary="torch.nn.attention.sdpa_kernel/SDPBackend where torch lacks them (1.13-2.2); "
    "F.scaled_dot_product_attention (torch 2.13's math backend) where it lacks that too (1.13)",
    torch="<2.3",
    upstream="https://pytorch.org/docs/2.3/generated/torch.nn.attention.sdpa_kernel.html",
    behaviour="F.scaled_dot_product_attention computed like torch 2.13's math backend, where torch lacks it",
)
PATCH.sets("torch.nn.functional", ("scaled_dot_product_attention",))

# The torch.backends.cuda flag of each backend (the names of torch._C._get_<name>_sdp_enabled).
FLAGS = {"flash": "FLASH_ATTENTION", "mem_efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


class SDPBackend(enum.IntEnum):
    """The SDPA backends of torch 2.0-2.2 (``torch.backends.cuda.SDPBackend``), for torch 1.13."""

    ERROR = -1
    MATH = 0
    FLASH_ATTENTION = 1
    EFFICIENT_ATTENTION = 2


@functools.lru_cache(maxsize=None)
def sdp_backend() -> type:
    """``SDPBackend`` of the installed torch, or the 2.0-2.2 enum where it has none."""
    import torch.backends.cuda

    return getattr(torch.backends.cuda, "SDPBackend", SDPBackend)


def _flags() -> Dict[str, bool]:
    """The SDPA backend flags this torch has, and their values."""
    import torch

    return {name: getattr(torch._C, f"_get_{name}_sdp_enabled")() for name in FLAGS
            if hasattr(torch._C, f"_get_{name}_sdp_enabled")}


def _set_flags(flags: Dict[str, bool]) -> None:
    import torch

    for name, enabled in flags.items():
        getattr(torch._C, f"_set_sdp_use_{name}")(enabled)


@contextlib.contextmanager
def sdpa_kernel(backends: Union[List[Any], Any], set_priority: bool = False) -> Iterator[Dict[str, Any]]:
    r"""Context manager to select which backend to use for scaled dot product attention.

    Args:
        backends (Union[List[SDPBackend], SDPBackend]): A backend or list of backends for scaled dot product attention.
        set_priority (bool=False): Whether the ordering of the backends is interpreted as their priority order
            (needs a newer torch's priority order: ``NotImplementedError`` here).

    Only the given backends are enabled inside the block; upon exiting, the previous state of the
    flags is restored.
    """
    backend_type = sdp_backend()
    if not isinstance(backends, (list, backend_type)):
        raise AssertionError(
            f"Backend must be an instance of SDPBackend or a list of SDPBackend instances, got {type(backends).__name__}"
        )
    if set_priority:
        import torch

        raise NotImplementedError(
            f"sdpa_kernel(..., set_priority=True) needs the SDPA backend priority order of a newer torch; torch "
            f"{torch.__version__} has none. Leave set_priority at False to enable the backends without an order."
        )
    if isinstance(backends, backend_type):
        backends = [backends]
    previous = _flags()
    try:
        _set_flags({name: getattr(backend_type, FLAGS[name]) in backends for name in previous})
        yield {}
    finally:
        _set_flags(previous)


PATCH.sets("torch.nn.attention", ("SDPBackend", "sdpa_kernel"))


@PATCH.module("torch.nn.attention")
def build_attention(module: ModuleType) -> None:
    module.__doc__ = ("This module contains functions and classes that alter the behavior of "
                      "torch.nn.functional.scaled_dot_product_attention (served by torchpatch)")
    module.SDPBackend = sdp_backend()
    module.sdpa_kernel = sdpa_kernel
    module.__all__ = ["SDPBackend", "sdpa_kernel"]


# -- scaled_dot_product_attention for torch 1.13 ---------------------------------------------------
# Scalar-type names as torch's C++ errors print them.
_C10_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half", "bfloat16": "c10::BFloat16",
              "int64": "long int", "int32": "int", "int16": "short int", "int8": "signed char", "uint8": "unsigned char"}


def _c10(dtype: "torch.dtype") -> str:
    name = str(dtype).replace("torch.", "")
    return _C10_NAMES.get(name, name)


def _validate(query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor",
              attn_mask: Optional["torch.Tensor"]) -> None:
    import torch

    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(f"Expected query, key, and value to have the same dtype, but got query.dtype: "
                           f"{_c10(query.dtype)} key.dtype: {_c10(key.dtype)} and value.dtype: {_c10(value.dtype)} instead.")
    if not (query.device == key.device == value.device):
        raise RuntimeError(f"Expected query, key, and value to have the same device type, but got query.device: "
                           f"{query.device} key.device: {key.device} and value.device: {value.device} instead.")
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise RuntimeError(f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
                           f"{query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    if attn_mask is not None:
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise RuntimeError(f"Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                               f"attn_mask.dtype: {_c10(attn_mask.dtype)} and  query.dtype: {_c10(query.dtype)} instead.")
        if attn_mask.device != query.device:
            raise RuntimeError(f"Expected attn_mask device to match query device, but got attn_mask.device: "
                               f"{attn_mask.device} and query.device: {query.device} instead.")


def scaled_dot_product_attention(query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor",
                                 attn_mask: Optional["torch.Tensor"] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> "torch.Tensor":
    r"""Computes scaled dot product attention on query, key and value tensors, using an optional
    attention mask if passed, and applying dropout if a probability greater than 0.0 is specified.

    ``softmax(Q K^T * scale + mask) V`` with torch 2.13's math-backend semantics (see the
    sdpa-backport patch): ``attn_mask`` boolean (True takes part in attention) or additive float,
    ``is_causal`` a lower-left triangular mask, ``scale`` defaulting to ``1/sqrt(E)``,
    ``enable_gqa`` for grouped-query attention. Shapes: query ``(N, ..., Hq, L, E)``, key
    ``(N, ..., H, S, E)``, value ``(N, ..., H, S, Ev)``; the result is ``(N, ..., Hq, L, Ev)``.
    """
    import torch

    _validate(query, key, value, attn_mask)
    if not any(_flags().values()):
        raise RuntimeError("No viable backend for scaled_dot_product_attention was found. This is likely due to "
                           "turning off both the math kernel and the fused kernels.")
    origin_dtype = query.dtype
    if origin_dtype in (torch.float16, torch.bfloat16):  # computed in float32, as torch's math backend does
        query, key, value = query.float(), key.float(), value.float()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=origin_dtype, device=attn_mask.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    softmax_scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else float(scale)
    scaling_factor = math.sqrt(abs(softmax_scale))
    query = query * (-scaling_factor if softmax_scale < 0 else scaling_factor)
    if is_causal:
        if attn_mask is not None:
            raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set when is_causal=True")
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        attn_mask = torch.zeros(causal.shape, dtype=query.dtype, device=query.device).masked_fill(
            causal.logical_not(), float("-inf"))
    if enable_gqa:
        key, value = _repeat_kv_heads(query, key, value)
    attn = torch.matmul(query, key.transpose(-2, -1) * scaling_factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    weights = torch.softmax(attn, -1)
    fully_masked = attn.eq(float("-inf")).all(-1, keepdim=True)
    weights = torch.where(fully_masked, torch.zeros((), dtype=weights.dtype, device=weights.device), weights)
    if dropout_p > 0.0:
        weights = torch.dropout(weights, dropout_p, True)
    return torch.matmul(weights, value).to(origin_dtype)


def _repeat_kv_heads(query: "torch.Tensor", key: "torch.Tensor", value: "torch.Tensor") -> Any:
    """Grouped-query attention: each key/value head serves ``Hq / H`` query heads."""
    q_heads, k_heads, v_heads = query.size(-3), key.size(-3), value.size(-3)
    if q_heads == k_heads == v_heads:
        return key, value
    if q_heads % k_heads or q_heads % v_heads:
        raise RuntimeError("Number of heads in key and value must divide the number of heads in query")
    return key.repeat_interleave(q_heads // k_heads, -3), value.repeat_interleave(q_heads // v_heads, -3)


@PATCH.on_import("torch.nn.functional")
def set_scaled_dot_product_attention(patcher: Patcher, functional: ModuleType) -> bool:
    if "scaled_dot_product_attention" in vars(functional):
        return False
    patcher.setattr(functional, "scaled_dot_product_attention", scaled_dot_product_attention)
    return True

"""``flex_attention``: attention whose scores a ``score_mod`` rewrites and a ``BlockMask`` masks, computed
as torch 2.15 computes it without torch.compile (its dense "math" path): the whole score matrix is
materialised, so memory grows with Q_LEN x KV_LEN."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Set, Tuple, Union

import torch
import torch._dynamo
from torch import Tensor

from .._heads import check_gqa_heads
from ..flex_attention_aux import AuxOutput, AuxRequest
from .block_mask import _LARGE_SPARSE_BLOCK_SIZE, BlockMask, _ordered_to_dense, _sliced_mask_mod_error
from .mods import _MODULE, _identity, _score_mod_signature, evaluate

_BLOCK_MASK_TOO_SMALL_ERROR = ("block_mask was created for a smaller length than you're using it for, you likely "
                               "need to create a new block mask.")
_BLOCK_MASK_TOO_LARGE_ERROR = (
    "block_mask was created for a larger length than you're using it for, you can either 1. create a new "
    "block mask with the correct length, or 2. 'adjust' the existing block mask to the correct length by "
    "calling block_mask._adjust(q_len, kv_len). This essentially 'crops' the block mask to the upper left "
    "corner, which does not work for all mask_mods!")
_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")
_warned: Set[str] = set()


def _warn_once(key: str, message: str, category: type) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=3)


def _validate(query: Tensor, key: Tensor, value: Tensor, block_mask: Optional[BlockMask], enable_gqa: bool) -> None:
    """torch 2.15's checks of the inputs, with its errors."""
    if query.is_nested or key.is_nested or value.is_nested:
        raise NotImplementedError(
            "flex_attention does not support NestedTensor inputs, including torch.compile(flex_attention) with "
            "jagged NestedTensor inputs. Convert inputs to dense tensors before calling flex_attention.")
    if query.device != key.device or query.device != value.device:
        raise ValueError(
            f"Expected query, key, and value to have the same device type, but got query.device: {query.device}, "
            f"key.device: {key.device}, and value.device: {value.device} instead.")
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise ValueError(
            f"Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: {query.dim()}, "
            f"key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    if query.size(-1) != key.size(-1):
        raise ValueError(f"Expect query and key/value to have the same embedding dimension but got "
                         f"E={query.size(-1)} and E={key.size(-1)}.")
    device = query.device.type
    if device in ("cpu", "mps") and (query.requires_grad or key.requires_grad or value.requires_grad):
        raise NotImplementedError(
            f"FlexAttention does not support backward on {device.upper()}. Please set the input requires_grad to "
            f"False or use another device.")
    if device not in ("cuda", "cpu", "xpu", "hpu", "mps"):
        raise ValueError(f"FlexAttention is only supported on CUDA, CPU, HPU, or MPS devices. Found input tensors "
                         f"on {device} device.")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise NotImplementedError("NYI: query, key, and value must be 4D tensors")
    check_gqa_heads(query.size(1), key.size(1), enable_gqa)
    Bq, Bkv = query.size(0), key.size(0)
    if Bq != Bkv and block_mask is None:
        raise ValueError(f"Expect query and key/value to have the same batch size, or non-none block_mask, but "
                         f"got block_mask=None, Bq={Bq}, and Bkv={Bkv}.")
    if Bq != Bkv and block_mask.kv_num_blocks.size(0) != Bq:
        raise ValueError(f"Expect query and key/value to have the same batch size, or block_mask and query to "
                         f"have the same batch size, but got Bq={Bq}, Bkv={Bkv}, "
                         f"B_block_mask={block_mask.kv_num_blocks.size(0)}.")


def _validate_block_mask(block_mask: BlockMask, query: Tensor, key: Tensor) -> None:
    if block_mask.mask_mod is _sliced_mask_mod_error:
        raise RuntimeError("Cannot use mask_mod from a sliced BlockMask")
    (q_len, kv_len), (mask_q_len, mask_kv_len) = (query.size(-2), key.size(-2)), block_mask.shape[-2:]
    if q_len > mask_q_len or kv_len > mask_kv_len:
        raise RuntimeError(_BLOCK_MASK_TOO_SMALL_ERROR)
    if q_len < mask_q_len or kv_len < mask_kv_len:
        raise RuntimeError(_BLOCK_MASK_TOO_LARGE_ERROR)
    if query.device != block_mask.kv_num_blocks.device:
        raise RuntimeError(f"Expect q/k/v and block_mask to be on the same device but got {query.device} and "
                           f"{block_mask.kv_num_blocks.device}.")


def _validate_options(kernel_options: Optional[Dict[str, Any]], return_aux: Optional[AuxRequest],
                      query: Tensor, key: Tensor, value: Tensor) -> None:
    """torch 2.15's checks of ``kernel_options`` and ``return_aux``; the options themselves choose and
    tune kernels, which the unfused computation (torch's eager one too) does not use."""
    options = kernel_options or {}
    if "BACKEND" in options and options.get("FORCE_USE_FLEX_ATTENTION", False):
        raise RuntimeError("BACKEND cannot be combined with legacy FORCE_USE_FLEX_ATTENTION. BACKEND supersedes the "
                           "legacy knob; please drop FORCE_USE_FLEX_ATTENTION and only specify the desired BACKEND.")
    if "BACKEND" in options and options["BACKEND"] not in _BACKENDS:
        raise ValueError(f"Invalid BACKEND value '{options['BACKEND']}'. Must be one of {_BACKENDS}")
    for internal in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
        if internal in options:
            raise AssertionError(f"{internal} must not be in kernel_options")
    if return_aux is None or not return_aux.max_scores:
        return
    if options.get("BACKEND") == "FLASH":
        raise NotImplementedError("Returning max scores is not supported with BACKEND='FLASH'. Use "
                                  "return_aux=AuxRequest(lse=True) or omit max_scores.")
    if "cpu" in (query.device.type, key.device.type, value.device.type):
        raise NotImplementedError("Returning max scores is not supported on CPU.")


def _allowed(block_mask: BlockMask, B: int, H: int, Q: int, KV: int, device: torch.device) -> Tensor:
    """Where attention is allowed, [B, H, Q, KV] (bool): full blocks entirely, partial blocks where
    the mask_mod says so, nothing elsewhere."""
    index = [torch.arange(0, n, device=device) for n in (B, H, Q, KV)]
    by_mask_mod = evaluate(block_mask.mask_mod, *index)
    if block_mask.BLOCK_SIZE == (_LARGE_SPARSE_BLOCK_SIZE, _LARGE_SPARSE_BLOCK_SIZE):
        return by_mask_mod.expand(B, H, Q, KV)

    def elements(num_blocks: Tensor, indices: Tensor) -> Tensor:
        grid = _ordered_to_dense(num_blocks, indices, indices.shape[-1]).bool()
        q_block, kv_block = block_mask.BLOCK_SIZE
        grid = grid.repeat_interleave(q_block, dim=-2).repeat_interleave(kv_block, dim=-1)
        return grid[..., :Q, :KV].expand(B, H, Q, KV)

    allowed = elements(block_mask.kv_num_blocks, block_mask.kv_indices) & by_mask_mod
    if block_mask.full_kv_num_blocks is not None:
        allowed = allowed | elements(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return allowed


@torch._dynamo.disable  # torch 2.4's Inductor cannot compile it: it runs eagerly under torch.compile too
def _attention(query: Tensor, key: Tensor, value: Tensor, score_mod: _score_mod_signature,
               block_mask: BlockMask, scale: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(output, logsumexp, row maxima): scores in float32 (float64 for float64 inputs), kv heads repeated
    for GQA, a row with nothing allowed giving output 0 and logsumexp/maximum -inf."""
    groups = query.size(1) // key.size(1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    B, H, Q, KV = query.size(0), query.size(1), query.size(2), key.size(2)
    if key.size(0) not in (B, 1):
        raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={B} and Bkv={key.size(0)}")
    key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])
    precision = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = (query.to(precision) @ key.to(precision).transpose(-2, -1)) * scale
    index = [torch.arange(0, n, device=query.device) for n in (B, H, Q, KV)]
    modified = evaluate(score_mod, *index, score=scores).to(precision)
    allowed = _allowed(block_mask, B, H, Q, KV, query.device)
    scores = torch.where(allowed, modified, torch.tensor(-math.inf, dtype=precision, device=query.device))
    empty_rows = ~allowed.any(dim=-1)
    logsumexp = torch.where(empty_rows, -math.inf, scores.logsumexp(dim=-1))
    row_max = scores.max(dim=-1).values
    # softmax of a row of -inf is nan (and so is its gradient): give such rows zeros instead
    probabilities = torch.where(empty_rows[..., None], 0.0, scores).softmax(dim=-1)
    probabilities = torch.where(empty_rows[..., None], 0.0, probabilities)
    out = probabilities.to(query.dtype) @ value.to(query.dtype)
    order = sorted(range(4), key=lambda dim: -query.stride(dim))  # lay the output out as the query is
    out = out.permute(order).contiguous().permute([order.index(dim) for dim in range(4)])
    return out, logsumexp, row_max


def flex_attention(query: Tensor, key: Tensor, value: Tensor, score_mod: Optional[_score_mod_signature] = None,
                   block_mask: Optional[BlockMask] = None, scale: Optional[float] = None, enable_gqa: bool = False,
                   return_lse: bool = False, kernel_options: Optional[Dict[str, Any]] = None, *,
                   return_aux: Optional[AuxRequest] = None) -> Union[Tensor, Tuple[Tensor, Any]]:
    r"""Scaled dot product attention with a user-defined score modification (FlexAttention), as torch
    2.15 computes it without torch.compile: ``softmax(where(mask, score_mod(q·kᵀ·scale, b, h, q_idx,
    kv_idx), -inf)) @ v``, the mask being the block mask's blocks (full ones entirely, partial ones where
    its ``mask_mod`` allows).

    Args:
        query (Tensor): (B, Hq, L, E). key (Tensor): (B, Hkv, S, E). value (Tensor): (B, Hkv, S, Ev).
        score_mod (Optional[Callable]): ``score_mod(score, b, h, q_idx, kv_idx)``; default: none.
        block_mask (Optional[BlockMask]): which blocks (and, through its mask_mod, elements) attend; default: all.
        scale (Optional[float]): default ``1/sqrt(E)``.
        enable_gqa (bool): broadcast the Hkv key/value heads to the Hq query heads.
        return_lse (bool): also return the logsumexp, (B, Hq, L) (deprecated: ``return_aux``).
        kernel_options: checked as torch checks them; they tune kernels this implementation does not have.
        return_aux (Optional[AuxRequest]): return ``(output, AuxOutput(lse, max_scores))`` with those requested.

    This torch (2.4) has no FlexAttention kernel: this computation runs, also under
    ``torch.compile(flex_attention)`` (the full score matrix, no fused kernel, no block skipping). Backward on CPU
    raises, as torch 2.15's does; on CUDA gradients flow through autograd. A row that attends to nothing
    gives output 0 and logsumexp -inf.
    """
    _validate(query, key, value, block_mask, enable_gqa)
    score_mod = _identity if score_mod is None else score_mod
    if block_mask is None:
        block_mask = BlockMask.from_kv_blocks(torch.ones([1, 1, 1], dtype=torch.int32, device=query.device),
                                              torch.zeros([1, 1, 1, 1], dtype=torch.int32, device=query.device),
                                              BLOCK_SIZE=_LARGE_SPARSE_BLOCK_SIZE, seq_lengths=(1, 1))
    else:
        _validate_block_mask(block_mask, query, key)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    if return_lse and return_aux is not None:
        raise ValueError("Cannot specify both return_lse and return_aux. return_lse is deprecated, please use "
                         "return_aux=AuxRequest(lse=True) instead.")
    if return_lse:
        _warn_once("return_lse", "return_lse is deprecated and will be removed in v2.10. Please use "
                                 "return_aux=AuxRequest(lse=True) instead.", FutureWarning)
    _validate_options(kernel_options, return_aux, query, key, value)
    _warn_once("unfused", f"flex_attention on torch {torch.__version__} (served by torchpatch) runs an unfused "
                          f"implementation that materializes the full scores matrix; torch.compile cannot fuse it on "
                          f"this torch (FlexAttention's kernels need torch >= 2.5).", UserWarning)
    out, logsumexp, row_max = _attention(query, key, value, score_mod, block_mask, scale)
    if return_aux is not None:
        return out, AuxOutput(lse=logsumexp if return_aux.lse else None,
                              max_scores=row_max if return_aux.max_scores else None)
    return (out, logsumexp) if return_lse else out


flex_attention.__module__ = _MODULE

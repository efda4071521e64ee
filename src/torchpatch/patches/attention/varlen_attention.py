"""varlen-attention: ``torch.nn.attention.varlen`` (``varlen_attn``, ``varlen_attn_out``,
``AuxRequest``) on torch 2.4-2.11 (where 2.10 and 2.11 lack only ``varlen_attn_out``).

What breaks:   code written for torch 2.10+ that runs attention over packed variable-length
               sequences dies on older torch: ``ModuleNotFoundError: No module named
               'torch.nn.attention.varlen'`` (2.4-2.9), ``ImportError: cannot import name
               'varlen_attn_out'`` (2.10, 2.11).
Torch:         2.10 added the module around the flash attention kernel every torch since 2.4 has
               (``aten::_flash_attention_forward`` with packed sequences, sliding windows and
               ``seqused_k``, differentiable); 2.12 added ``varlen_attn_out``; 2.15 also routes to
               cuDNN when it is enabled and eligible.
Fix:           serve the module with torch 2.15's semantics, computed by this torch's own flash kernel:
               - the same checks first: heads (``enable_gqa``), ``scale > 0``, ``window_size`` of
                 two; then 2.15's backend choice from ``sdpa_kernel``'s switches: flash enabled runs
                 flash; cuDNN alone raises 2.15's ``RuntimeError`` listing its unmet constraints, or,
                 where cuDNN would run, runs the flash kernel (this torch's cuDNN attention has no
                 packed sequences: same attention, another kernel); neither raises 2.15's "No viable
                 backend" error;
               - on CUDA: this torch's ``aten::_flash_attention_forward`` with 2.15's arguments
                 (window ``(-1, 0)`` is causal), differentiable; ``block_table`` (paged KV, which
                 this kernel lacks) gathers each sequence's pages first, then ``seqused_k`` bounds
                 them; ``seqused_k``/``block_table`` with gradients raise 2.15's inference-only
                 error; ``num_splits=1`` is what this kernel does for packed sequences (no split-KV),
                 other counts raise ``NotImplementedError`` (the kernel has no split-KV argument);
               - elsewhere: on meta tensors, outputs of 2.15's shapes (output like query with value's
                 head dim, float32 logsumexp of shape (H_q, T_q)); on CPU and other devices the
                 dispatcher's own ``NotImplementedError`` for the flash operator 2.15 calls, as 2.15
                 raises there;
               - ``varlen_attn_out(out, ...)`` writes the output into ``out`` and returns it (not
                 differentiable, as 2.15's custom op); ``return_aux=AuxRequest(lse=True)`` adds the
                 logsumexp.
Upstream:      https://github.com/pytorch/pytorch/pull/164502 (varlen_attn, torch 2.10)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple, Union

from torchpatch import Patch

from ._heads import check_gqa_heads

PATCH = Patch(
    id="varlen-attention",
    summary="torch.nn.attention.varlen (varlen_attn, varlen_attn_out, AuxRequest; varlen_attn_out alone on "
            "2.10 and 2.11), on this torch's flash attention kernel",
    torch=">=2.4,<2.12",
    upstream="https://github.com/pytorch/pytorch/pull/164502",
)

_MODULE = "torch.nn.attention.varlen"
_NAMES = ("varlen_attn", "varlen_attn_out", "AuxRequest")
_CUDNN_SM100_FORWARD = frozenset({(192, 128), (192, 192), (256, 128), (256, 256)})
_CUDNN_SM100_BACKWARD = frozenset({(192, 128)})

Tensor = Any  # torch.Tensor; torch is imported on first call only


class AuxRequest(NamedTuple):
    """Which auxiliary outputs varlen_attn computes besides the attention output."""

    lse: bool = False


def _check_arguments(query: Tensor, key: Tensor, block_table: Optional[Tensor], enable_gqa: bool,
                     scale: Optional[float], window_size: Sequence[int]) -> List[int]:
    heads_q = query.size(1)
    heads_kv = key.size(2) if block_table is not None else key.size(1)
    check_gqa_heads(heads_q, heads_kv, enable_gqa)
    if scale is not None and not scale > 0:
        raise ValueError(f"scale must be greater than 0, got {scale}")
    window = list(window_size)
    if len(window) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window)}")
    return window


def _cudnn_constraints(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Optional[Tensor],
                       max_q: int, window: List[int], seqused_k: Optional[Tensor], block_table: Optional[Tensor],
                       num_splits: Optional[int]) -> List[str]:
    """What keeps torch 2.15's cuDNN varlen path from running these inputs (an empty list: it runs)."""
    import torch

    version, major = 0, None
    if query.is_cuda:
        version = torch.backends.cudnn.version() or 0
        major = torch.cuda.get_device_capability(query.device)[0]
    reasons = []
    if not query.is_cuda:
        reasons.append("query must be on CUDA")
    elif torch.version.hip is not None or version < 91800 or major not in (9, 10):
        reasons.append("cuDNN >= 9.18 on SM90 or SM100 is required")
    if max_q <= 128 and version < 92400:
        reasons.append("max_q <= 128 requires cuDNN >= 9.24")
    if query.dtype not in (torch.float16, torch.bfloat16):
        reasons.append("query dtype must be float16 or bfloat16")
    dims = (query.shape[-1], value.shape[-1])
    if dims[0] % 8 or dims[1] % 8:
        reasons.append("query and value head dimensions must be divisible by 8")
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    large = _CUDNN_SM100_BACKWARD if backward else _CUDNN_SM100_FORWARD
    if not (max(dims) <= 128 or (major == 10 and version >= (91900 if backward else 92400) and dims in large)):
        reasons.append(f"query/value head dimensions {dims} are unsupported for cuDNN varlen "
                       f"{'backward' if backward else 'forward'}")
    if window == [-1, 0]:
        if seqused_k is not None and version < 92400:
            reasons.append("causal attention with a KV cache requires cuDNN >= 9.24")
        elif seqused_k is None and cu_seq_q is not cu_seq_k:
            reasons.append("causal attention requires seqused_k or the same cu_seq tensor for Q and K")
    elif window != [-1, -1]:
        reasons.append("window_size must be (-1, -1) or causal (-1, 0)")
    if num_splits is not None:
        reasons.append("num_splits is not supported")
    if block_table is not None:
        page = key.size(1)
        if page <= 0 or page & (page - 1):
            reasons.append("paged KV requires a power-of-two page size")
        if seqused_k is None:
            reasons.append("block_table requires seqused_k")
    return reasons


def _choose_backend(*args: Any) -> None:
    """torch 2.15's choice, from sdpa_kernel's switches: returns where an enabled backend would run."""
    import torch

    if torch._C._get_flash_sdp_enabled():
        return
    if torch._C._get_cudnn_sdp_enabled():
        reasons = _cudnn_constraints(*args)
        if not reasons:
            return
        listed = "\n  - ".join(reasons)
        raise RuntimeError("SDPBackend.CUDNN_ATTENTION was requested for varlen_attn, but its constraints are "
                           f"not satisfied:\n  - {listed}")
    raise RuntimeError("No viable backend for varlen_attn. Enable SDPBackend.FLASH_ATTENTION or "
                       "SDPBackend.CUDNN_ATTENTION with sdpa_kernel().")


def _unpage(key: Tensor, value: Tensor, block_table: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Paged KV (pages of ``page_size`` tokens, ``block_table[i]`` listing sequence i's pages) as packed
    sequences of ``pages * page_size`` tokens each, and their cumulative positions."""
    import torch

    pages = block_table.long()
    batch, per_sequence = pages.shape
    tokens = per_sequence * key.size(1)
    key, value = (t[pages].flatten(0, 2) for t in (key, value))
    cu_seq_k = torch.arange(batch + 1, device=key.device, dtype=torch.int32) * tokens
    return key, value, cu_seq_k


def _attention(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Optional[Tensor],
               max_q: int, max_k: int, scale: Optional[float], window: List[int], seqused_k: Optional[Tensor],
               block_table: Optional[Tensor], num_splits: Optional[int], operator: str) -> Tuple[Tensor, Tensor]:
    """(output, logsumexp) as torch 2.15's flash path computes them, on this torch's flash kernel."""
    import torch

    flash = torch.ops.aten._flash_attention_forward
    is_causal = window == [-1, 0]
    if query.device.type == "meta":
        out = query.new_empty((*query.shape[:-1], value.size(-1)))
        return out, torch.empty((query.size(1), query.size(0)), dtype=torch.float, device=query.device)
    if not query.is_cuda:  # the dispatcher's own error, for the operator torch 2.15 calls
        try:
            flash(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, is_causal, False, scale=scale)
        except NotImplementedError as error:
            raise NotImplementedError(str(error).replace("aten::_flash_attention_forward", operator)) from None
    if (seqused_k is not None or block_table is not None) and torch.is_grad_enabled() \
            and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError(f"{'seqused_k' if seqused_k is not None else 'block_table'} is an inference-only parameter.")
    if num_splits not in (None, 1):
        raise NotImplementedError(
            f"varlen_attn(num_splits={num_splits}) needs torch >= 2.10's flash kernel: this torch's "
            f"({torch.__version__}) has no split-KV for packed sequences (num_splits=None or 1 run as one split)")
    if block_table is not None:
        key, value, cu_seq_k = _unpage(key, value, block_table)
    out, lse = flash(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, is_causal, False, scale=scale,
                     window_size_left=window[0], window_size_right=window[1], seqused_k=seqused_k)[:2]
    return out, lse


def varlen_attn(query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Optional[Tensor],
                max_q: int, max_k: int, *, return_aux: Optional[AuxRequest] = None, scale: Optional[float] = None,
                window_size: Tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                seqused_k: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                num_splits: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over packed variable-length sequences: query ``(T_q, H_q, D)``, key/value
    ``(T_k, H_kv, D)`` (or pages ``(pages, page_size, H_kv, D)`` with ``block_table``), sequence i
    spanning ``cu_seq_q[i]:cu_seq_q[i+1]``; ``window_size`` ``(left, right)``, ``(-1, 0)`` causal.
    Returns the output ``(T_q, H_q, D)``, and with ``return_aux.lse`` the logsumexp ``(H_q, T_q)``."""
    window = _check_arguments(query, key, block_table, enable_gqa, scale, window_size)
    arguments = (query, key, value, cu_seq_q, cu_seq_k, max_q, window, seqused_k, block_table, num_splits)
    _choose_backend(*arguments)
    out, lse = _attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, seqused_k,
                          block_table, num_splits, "aten::_flash_attention_forward")
    return (out, lse) if return_aux is not None and return_aux.lse else out


def varlen_attn_out(out: Tensor, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor,
                    cu_seq_k: Optional[Tensor], max_q: int, max_k: int, *, return_aux: Optional[AuxRequest] = None,
                    scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1), enable_gqa: bool = False,
                    seqused_k: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                    num_splits: Optional[int] = None) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """:func:`varlen_attn` writing its output into ``out`` (returned)."""
    import torch

    window = _check_arguments(query, key, block_table, enable_gqa, scale, window_size)
    arguments = (query, key, value, cu_seq_q, cu_seq_k, max_q, window, seqused_k, block_table, num_splits)
    _choose_backend(*arguments)
    with torch.no_grad():
        result, lse = _attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, seqused_k,
                                 block_table, num_splits, "aten::_flash_attention_forward_no_dropout_inplace")
        out.copy_(result)
    return (out, lse) if return_aux is not None and return_aux.lse else out


for _served in (AuxRequest, varlen_attn, varlen_attn_out):
    _served.__module__ = _MODULE

PATCH.sets(_MODULE, _NAMES)


@PATCH.module(_MODULE)
def build(module: ModuleType) -> None:
    module.AuxRequest, module.varlen_attn, module.varlen_attn_out = AuxRequest, varlen_attn, varlen_attn_out
    module.__all__ = ["varlen_attn", "varlen_attn_out", "AuxRequest"]


@PATCH.symbol(_MODULE, "varlen_attn_out")
def _varlen_attn_out() -> Any:
    return varlen_attn_out  # torch 2.10 and 2.11: their module lacks only this

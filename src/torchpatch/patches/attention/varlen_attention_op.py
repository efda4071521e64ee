"""varlen-attention-op: the operator ``torch.ops.torch_attn._varlen_attn``, torch 2.4-2.9.

What breaks:   torchtitan 0.2.2 names ``torch.ops.torch_attn._varlen_attn.default`` in the set of
               outputs its selective activation checkpointing saves (``models/*/infra/parallelize.py``,
               at module level), so on torch 2.9 nothing trains: ``AttributeError: '_OpNamespace'
               'torch_attn' object has no attribute '_varlen_attn'``.
Torch:         2.4-2.9, where varlen-attention serves ``torch.nn.attention.varlen``; torch 2.10+
               defines the operator when that module is imported, as its forward.
Fix:           define it when ``torch.nn.attention.varlen`` is imported, with torch 2.15's schema, its
               results (output, logsumexp and a zero random-number state of two uint64) computed by
               varlen-attention's flash path; a ``backend`` other than flash (1) is torch's own
               assertion. Not served: its autograd (calling it on tensors that require grad and
               differentiating raises torch's "no autograd" error) and the use of it by the served
               ``varlen_attn``, which calls the flash kernel itself: a checkpointing policy that
               names this operator recomputes that attention (same values) instead of saving it.
Upstream:      https://github.com/pytorch/pytorch/pull/164502 (varlen_attn and its operator, torch 2.10)
"""

from types import ModuleType
from typing import Any, List, Optional, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="varlen-attention-op",
    summary="torch.ops.torch_attn._varlen_attn (torch 2.10's varlen forward operator), on varlen-attention",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/164502",
    requires=("varlen-attention",),
    errors=(
        Error(r"'_OpNamespace' 'torch_attn' object has no attribute '_varlen_attn'",
              "AttributeError: '_OpNamespace' 'torch_attn' object has no attribute '_varlen_attn'"),
    ),
)

SCHEMA = ("_varlen_attn(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor? cu_seq_k, SymInt max_q, "
          "SymInt max_k, bool is_causal=False, float? scale=None, SymInt[]? window_size=None, bool enable_gqa=False, "
          "Tensor? seqused_k=None, Tensor? block_table=None, SymInt? num_splits=None, SymInt backend=1) "
          "-> (Tensor, Tensor, Tensor)")
_FLASH = 1
PATCH.sets("torch.ops.torch_attn", ("_varlen_attn",))  # for ``torchpatch check``


def _varlen_attn(query: Any, key: Any, value: Any, cu_seq_q: Any, cu_seq_k: Optional[Any], max_q: int, max_k: int,
                 is_causal: bool = False, scale: Optional[float] = None, window_size: Optional[List[int]] = None,
                 enable_gqa: bool = False, seqused_k: Optional[Any] = None, block_table: Optional[Any] = None,
                 num_splits: Optional[int] = None, backend: int = _FLASH) -> Tuple[Any, Any, Any]:
    import torch

    from .varlen_attention import _attention

    if backend != _FLASH:
        raise AssertionError(f"Unsupported varlen attention backend: {backend}")
    window = list(window_size) if window_size is not None else ([-1, 0] if is_causal else [-1, -1])
    out, lse = _attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window, seqused_k, block_table,
                          num_splits, "torch_attn::_varlen_attn")
    return out, lse, torch.zeros((2,), dtype=torch.uint64, device=query.device)


def _defined() -> bool:
    """Whether some library already defines the operator (asked without making ``torch.ops.torch_attn``)."""
    import torch

    try:
        torch._C._get_schema("torch_attn::_varlen_attn", "")
    except RuntimeError:
        return False
    return True


@PATCH.on_import("torch.nn.attention.varlen")
def define_operator(patcher: Patcher, varlen: ModuleType) -> bool:
    import torch

    if _defined():
        return False
    # undone last to first: torch.ops makes (and keeps) its namespace at the first lookup of
    # torch.ops.torch_attn (the library's _destroy looks it up too), so it goes after the library
    patcher.on_undo(lambda: vars(torch.ops).pop("torch_attn", None))
    library = torch.library.Library("torch_attn", "FRAGMENT")  # owns the definition while the patch is on
    library.define(SCHEMA)
    library.impl("_varlen_attn", _varlen_attn, "CompositeExplicitAutograd")
    patcher.on_undo(library._destroy)
    return True

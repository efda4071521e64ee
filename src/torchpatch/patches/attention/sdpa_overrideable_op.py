"""sdpa-overrideable-op: the operator ``torch.ops.aten._scaled_dot_product_fused_attention_overrideable``
on torch 2.4.

What breaks:   torchtitan 0.2.2 names ``torch.ops.aten._scaled_dot_product_fused_attention_overrideable.default``
               in the set of outputs its selective activation checkpointing saves
               (``models/*/infra/parallelize.py``, at module level), so on torch 2.4 nothing trains:
               ``AttributeError: '_OpNamespace' 'aten' object has no attribute
               '_scaled_dot_product_fused_attention_overrideable'``.
Torch:         2.5 added the operator as a hook for out-of-tree (PrivateUse1) backends to implement their
               fused attention: torch's own kernel for every backend (CompositeExplicitAutograd) raises
               ``_scaled_dot_product_fused_attention_overrideable not implemented``, and CPU and CUDA
               SDPA never dispatch to it.
Fix:           define it with torch 2.15's schema and that kernel, which raises ``NotImplementedError``
               with 2.15's text; a checkpointing policy can then name it (nothing on this torch runs it).
               Not served: its backward operator (``..._overrideable_backward``), which no backend of
               torch 2.4 could call either.
Upstream:      https://github.com/pytorch/pytorch/pull/131756 (the overrideable SDPA operator, torch 2.5)
"""

from types import ModuleType
from typing import Any, NoReturn

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="sdpa-overrideable-op",
    summary="torch.ops.aten._scaled_dot_product_fused_attention_overrideable (torch 2.5's hook for out-of-tree "
    "backends; its kernel raises, as torch's own)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/131756",
    errors=(
        Error(r"'_OpNamespace' 'aten' object has no attribute '_scaled_dot_product_fused_attention_overrideable'",
              "AttributeError: '_OpNamespace' 'aten' object has no attribute "
              "'_scaled_dot_product_fused_attention_overrideable'"),
    ),
)

NAME = "_scaled_dot_product_fused_attention_overrideable"
PATCH.sets("torch.ops.aten", (NAME,))  # for ``torchpatch check``: define_operator makes it
SCHEMA = (f"{NAME}(Tensor query, Tensor key, Tensor value, Tensor? attn_bias=None, float dropout_p=0.0, "
          "bool is_causal=False, bool return_debug_mask=False, *, float? scale=None) -> (Tensor output, "
          "Tensor logsumexp, Tensor cum_seq_q, Tensor cum_seq_k, SymInt max_q, SymInt max_k, Tensor philox_seed, "
          "Tensor philox_offset, Tensor debug_attn_mask)")


def _not_implemented(*args: Any, **kwargs: Any) -> NoReturn:
    raise NotImplementedError(f"{NAME} not implemented. This is an operator for privateuse1 backends, please use "
                              "TORCH_LIBRARY_IMPL to override this function ")


def _defined() -> bool:
    import torch

    try:
        torch._C._get_schema(f"aten::{NAME}", "")
    except RuntimeError:
        return False
    return True


@PATCH.on_import("torch")
def define_operator(patcher: Patcher, torch: ModuleType) -> bool:
    if _defined():
        return False
    # undone last to first: torch.ops.aten keeps the operator's packet once looked up
    patcher.on_undo(lambda: vars(torch.ops.aten).pop(NAME, None))
    library = torch.library.Library("aten", "FRAGMENT")  # owns the definition while the patch is on
    library.define(SCHEMA)
    library.impl(NAME, _not_implemented, "CompositeExplicitAutograd")
    patcher.on_undo(library._destroy)
    return True

"""sdpa-enable-gqa: ``F.scaled_dot_product_attention(..., enable_gqa=...)`` (grouped-query attention) on
torch 2.3-2.4.

What breaks:   attention written for torch 2.5+ passes ``enable_gqa`` (torchtitan 0.2.2's
               ``ScaledDotProductAttention`` always does, ``enable_gqa=False`` included; 0.3.0's attention
               modules; examples/torchtitan_cpu.py's CPU FlexAttention, which is SDPA with the block mask
               made dense): on torch 2.4 every forward dies with
               ``TypeError: scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'``.
Torch:         2.5 added the argument: with it, key and value may have fewer heads than the query (a
               divisor of them), each key/value head serving ``Hq / Hkv`` consecutive query heads, as
               torch's math reference computes it (``repeat_interleave`` over the head dim); a head count
               that does not divide raises. Without it, or with equal head counts, nothing changes. torch
               1.13-2.2 get the whole function, ``enable_gqa`` included, from sdpa-backport.
Fix:           wrap this torch's function: ``enable_gqa=False`` (the default) calls it unchanged, bit for
               bit; ``enable_gqa=True`` repeats key and value heads as 2.15's reference does
               (sdpa-backport's ``_repeat_kv_heads``, its ``RuntimeError`` for heads that do not divide)
               and calls it with the repeated tensors, so every kernel choice stays this torch's. On torch
               2.15.0's CPU the output is bitwise its native GQA's and the key/value gradients equal to
               rounding (their group sums are added in another order: 4.8e-7 measured).
Upstream:      https://github.com/pytorch/pytorch/pull/132689 (enable_gqa, torch 2.5)
"""

import inspect
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="sdpa-enable-gqa",
    summary="F.scaled_dot_product_attention(enable_gqa=...) on torch 2.3-2.4: key/value heads repeated over the "
            "query heads (torch 2.15's reference), then this torch's kernel",
    torch=">=2.3,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/132689",
    behaviour="F.scaled_dot_product_attention(enable_gqa=...)",
    errors=(
        Error(r"scaled_dot_product_attention\(\) got an unexpected keyword argument 'enable_gqa'",
              "TypeError: scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'"),
    ),
)


def _with_gqa(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    kwargs = dict(kwargs)  # enable_gqa is keyword-only (as scale), as in torch 2.15's schema
    if not kwargs.pop("enable_gqa", False):
        return wrapped(*args, **kwargs)
    from .sdpa_backport import _repeat_kv_heads

    query, key, value = (tuple(args) + (None,) * 3)[:3]  # each may be given by name instead
    query = kwargs.pop("query", query)
    key, value = _repeat_kv_heads(query, kwargs.pop("key", key), kwargs.pop("value", value))
    return wrapped(query, key, value, *args[3:], **kwargs)


@PATCH.on_import("torch.nn.functional")
def accept_enable_gqa(patcher: Patcher, functional: ModuleType) -> bool:
    """Wrap the function unless it takes ``enable_gqa`` already (its signature, or a builtin's docstring)."""
    sdpa = getattr(functional, "scaled_dot_product_attention", None)
    if sdpa is None or "enable_gqa" in (getattr(sdpa, "__doc__", "") or ""):
        return False
    try:
        if "enable_gqa" in inspect.signature(sdpa).parameters:
            return False
    except (TypeError, ValueError):  # a builtin without a signature
        pass
    patcher.wrap(functional, "scaled_dot_product_attention", _with_gqa)
    return True

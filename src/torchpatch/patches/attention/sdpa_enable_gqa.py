"""sdpa-enable-gqa: ``F.scaled_dot_product_attention(..., enable_gqa=...)`` on torch 2.3-2.4.

What breaks:   code written for torch >= 2.5 passes ``enable_gqa`` (torchtitan 0.2.2's ``ScaledDotProductAttention``
               always does, ``enable_gqa=False`` included), so on torch 2.4 every forward dies with
               ``TypeError: scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'``.
Torch:         2.5 added ``enable_gqa``: with it, key and value may have fewer heads than the query (a
               divisor of them), each key/value head serving ``Hq // Hkv`` consecutive query heads; without
               it, or with equal head counts, nothing changes. torch 1.13-2.2 get the whole function
               from sdpa-backport.
Fix:           take ``enable_gqa``. ``False``, or equal head counts: torch 2.4's own call, bit for bit.
               ``True`` with fewer key/value heads: key and value are repeated (``repeat_interleave``
               over the head dimension, ``-3``), as torch 2.15's math backend does; on torch 2.15.0's
               CPU the output is bitwise the same as its native GQA and the key/value gradients equal
               to rounding (their group sums are added in another order: 4.8e-7 measured). A head count
               that does not divide the query's raises 2.15's ``RuntimeError``.
Upstream:      https://github.com/pytorch/pytorch/pull/132689 (enable_gqa, torch 2.5)
"""

from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="sdpa-enable-gqa",
    summary="F.scaled_dot_product_attention(enable_gqa=...) on torch 2.3-2.4 (key/value heads repeated, as 2.15's math "
    "backend)",
    torch=">=2.3,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/132689",
    behaviour="F.scaled_dot_product_attention(enable_gqa=...)",
)

_ARGS = ("query", "key", "value")


def _with_gqa(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if "enable_gqa" not in kwargs:
        return wrapped(*args, **kwargs)
    kwargs = dict(kwargs)
    if not kwargs.pop("enable_gqa"):
        return wrapped(*args, **kwargs)
    args = list(args)
    tensors = [args[i] if i < len(args) else kwargs[name] for i, name in enumerate(_ARGS)]
    query, key, value = tensors
    heads_q, heads_kv = query.size(-3), key.size(-3)
    if heads_kv != heads_q:
        if heads_q % heads_kv != 0 or value.size(-3) != heads_kv:
            raise RuntimeError("Number of heads in key and value must divide the number of heads in query")
        repeated = (key.repeat_interleave(heads_q // heads_kv, -3), value.repeat_interleave(heads_q // heads_kv, -3))
        for i, tensor in zip((1, 2), repeated):
            if i < len(args):
                args[i] = tensor
            else:
                kwargs[_ARGS[i]] = tensor
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.nn.functional")
def take_enable_gqa(patcher: Patcher, functional: Any) -> bool:
    """torch 2.3-2.4's builtin has no ``enable_gqa`` (and no signature to ask: the range says it)."""
    patcher.wrap(functional, "scaled_dot_product_attention", _with_gqa)
    return True

"""funcol-gather-negative-dim: ``all_gather_tensor(x, gather_dim=<negative>, group)`` concatenates
the wrong way, or fails, torch 2.10-2.14.

What breaks:   the functional all-gather lays the ranks' tensors out along dim 0 and then moves
               them to ``gather_dim`` with ``torch._utils._maybe_view_chunk_cat``, which takes a
               view instead of a copy when the input's dim 0 has size 1 (batch size 1, common in
               long-sequence training). Its shape arithmetic assumes ``gather_dim >= 0``: with a
               negative one it takes the view whenever dim 0 is 1, so gathering a
               ``[1, heads, seq, dim]`` tensor along ``-2`` (the sequence, as context/sequence
               parallel code writes it) silently returns rank 0's and rank 1's data interleaved
               wrongly, and ``-1`` or ``-ndim`` raise "shape ... is invalid". The same calls with
               the positive dim, and torch 2.9's chunk-and-cat, are right.
Torch:         the view path arrived after 2.9 (2.9.0 has no ``_maybe_view_chunk_cat``); 2.13.0
               and 2.14.1 give the wrong values (reproduced on gloo); 2.15.0 normalizes the dim.
Fix:           where ``_maybe_view_chunk_cat`` gets a negative dim wrong (asked of it on a small
               CPU tensor when the functional collectives are imported), it is replaced, in
               ``torch._utils`` and in ``torch.distributed._functional_collectives`` (which
               imported the name), by a plain function that makes ``gather_dim`` non-negative
               (``+= res.dim()``) and calls torch's own, as torch 2.15 does.
Upstream:      https://github.com/pytorch/pytorch/pull/194865 (fixes
               https://github.com/pytorch/pytorch/issues/194856)
"""

from types import ModuleType
from typing import Any, Callable

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="funcol-gather-negative-dim",
    summary="functional all_gather_tensor with a negative gather_dim gathers along the right dim",
    torch=">=2.10,<2.15",
    upstream="https://github.com/pytorch/pytorch/pull/194865",
    behaviour="_maybe_view_chunk_cat normalizes a negative gather_dim",
    category="correctness",
)


def _wrong_for_negative_dims(chunk_cat: Callable[..., Any]) -> bool:
    """Whether torch's ``_maybe_view_chunk_cat`` differs from chunk-and-cat for a negative dim."""
    import torch

    res = torch.arange(2 * 2 * 3 * 2).view(2, 2, 3, 2)  # 2 ranks' [1, 2, 3, 2] gathered on dim 0
    for dim in (-1, -2, -4):
        expected = torch.cat(torch.chunk(res, 2, dim=0), dim=dim)
        try:
            got = chunk_cat(res, 2, dim)
        except RuntimeError:
            return True
        if got.shape != expected.shape or not torch.equal(got, expected):
            return True
    return False


def _normalizing(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_view_chunk_cat(res: Any, group_size: int, gather_dim: int) -> Any:
        if gather_dim < 0:
            gather_dim += res.dim()
        return original(res, group_size, gather_dim)

    _maybe_view_chunk_cat.__doc__ = original.__doc__
    _maybe_view_chunk_cat.__wrapped__ = original  # type: ignore[attr-defined]
    return _maybe_view_chunk_cat


@PATCH.on_import("torch.distributed._functional_collectives")
def normalize_gather_dim(patcher: Patcher, funcol: ModuleType) -> bool:
    import torch._utils as utils

    original = getattr(utils, "_maybe_view_chunk_cat", None)
    if original is None or not _wrong_for_negative_dims(original):
        return False  # torch <= 2.9 (chunk and cat), or 2.15+ (normalized)
    fixed = _normalizing(original)
    patcher.setattr(utils, "_maybe_view_chunk_cat", fixed)
    if getattr(funcol, "_maybe_view_chunk_cat", None) is original:
        patcher.setattr(funcol, "_maybe_view_chunk_cat", fixed)
    return True

"""mask_mod and score_mod helpers: ``noop_mask``, ``and_masks``, ``or_masks``, ``create_mask``, and the
vectorised evaluation of a mod over every (batch, head, q_idx, kv_idx) that the others build on."""

from __future__ import annotations

import inspect
import warnings
from enum import Enum
from typing import Any, Callable, Optional, Set, Tuple, Type, Union

import torch
import torch._dynamo
from torch import Tensor

_mask_mod_signature = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
_score_mod_signature = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

_MODULE = "torch.nn.attention.flex_attention"
_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = False  # torch's switch to run flex_attention eagerly: this one always does
_WARNINGS_SHOWN: Set[str] = set()


def _warn_once(warning_id: str, message: str, category: Type[Warning] = UserWarning) -> None:
    """Warn once per process for ``warning_id`` (torch 2.15's helper; nothing here runs compiled)."""
    if warning_id not in _WARNINGS_SHOWN:
        warnings.warn(message, category, stacklevel=2)
        _WARNINGS_SHOWN.add(warning_id)


class _ModificationType(Enum):
    """A mod's kind, from its positional parameters: SCORE_MOD (5), MASK_MOD (4)."""

    SCORE_MOD = 1
    MASK_MOD = 2
    UNKNOWN = 3


_ModificationType.__module__ = _MODULE


def noop_mask(batch: Tensor, head: Tensor, token_q: Tensor, token_kv: Tensor) -> Tensor:
    """Returns a noop mask_mod"""
    return batch.new_ones(size=(), dtype=torch.bool, device=batch.device)


def _identity(score: Tensor, batch: Tensor, head: Tensor, token_q: Tensor, token_kv: Tensor) -> Tensor:
    """The score_mod that leaves the score as it is."""
    return score


def _combined(mask_mods: Tuple[_mask_mod_signature, ...], empty: bool,
              combine: Callable[[Tensor, Tensor], Tensor], name: str) -> _mask_mod_signature:
    """The mask_mod folding ``mask_mods``' masks with ``combine``, starting from ``empty``."""
    if not all(callable(arg) for arg in mask_mods):
        raise RuntimeError(f"All inputs should be callable mask_mods: {mask_mods}")

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = b.new_full((), empty, dtype=torch.bool)
        for each in mask_mods:
            result = combine(result, each(b, h, q_idx, kv_idx))
        return result

    mask_mod.__name__ = mask_mod.__qualname__ = name
    return mask_mod


def or_masks(*mask_mods: _mask_mod_signature) -> _mask_mod_signature:
    """Returns a mask_mod that's the union of provided mask_mods"""
    return _combined(mask_mods, False, torch.bitwise_or, "or_mask")


def and_masks(*mask_mods: _mask_mod_signature) -> _mask_mod_signature:
    """Returns a mask_mod that's the intersection of provided mask_mods"""
    return _combined(mask_mods, True, torch.bitwise_and, "and_mask")


def _get_mod_type(fn: Callable[..., Any]) -> _ModificationType:
    """SCORE_MOD for 5 positional parameters without default, MASK_MOD for 4; anything else raises
    torch's ``AssertionError``."""
    code = getattr(fn, "__code__", None)
    if code is not None:
        count = code.co_argcount - len(getattr(fn, "__defaults__", None) or ())
    else:
        count = sum(1 for p in inspect.signature(fn).parameters.values() if p.default is inspect.Parameter.empty)
    if count not in (4, 5):
        raise AssertionError(f"Expected 4 or 5 positional args, got {count}")
    return _ModificationType.SCORE_MOD if count == 5 else _ModificationType.MASK_MOD


def is_score_mod(fn: Callable[..., Any]) -> bool:
    return _get_mod_type(fn) is _ModificationType.SCORE_MOD


@torch._dynamo.disable  # torch 2.4's Inductor cannot compile the vmapped mod: it runs eagerly under torch.compile too
def evaluate(fn: Callable[..., Tensor], b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor,
             score: Optional[Tensor] = None) -> Tensor:
    """``fn`` at every (b, h, q_idx, kv_idx) of the index vectors: a [B, H, Q, KV] tensor. A score_mod
    gets the matching element of ``score`` ([B, H, Q, KV]) first. ``fn`` sees 0-dim tensors (vmapped
    over each index in turn) and may index tensors with them (``doc_ids[q_idx]``)."""
    from torch._higher_order_ops.flex_attention import TransformGetItemToIndex  # torch 2.4's own

    prefix: Tuple[Optional[int], ...] = () if score is None else (0,)
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=prefix + dims, out_dims=0)
    args = (b, h, q_idx, kv_idx) if score is None else (score, b, h, q_idx, kv_idx)
    with TransformGetItemToIndex():
        return fn(*args)


def create_mask(mod_fn: Union[_score_mod_signature, _mask_mod_signature], B: Optional[int], H: Optional[int],
                Q_LEN: int, KV_LEN: int, device: Any = None) -> Tensor:
    r"""This function creates a mask tensor from a mod_fn function.

    Args:
        mod_fn (Union[_score_mod_signature, _mask_mod_signature]): Function to modify attention scores.
        B (int): Batch size.
        H (int): Number of query heads.
        Q_LEN (int): Sequence length of query.
        KV_LEN (int): Sequence length of key/value.
        device (str): Device to run the mask creation on.

    Returns:
        mask (Tensor): A mask tensor with shape (B, H, M, N).
    """
    device = default_device() if device is None else device
    B, H = B or 1, H or 1
    index = [torch.arange(0, n, device=device) for n in (B, H, Q_LEN, KV_LEN)]
    if is_score_mod(mod_fn):
        return ~torch.isneginf(evaluate(mod_fn, *index, score=torch.zeros(B, H, Q_LEN, KV_LEN, device=device)))
    return evaluate(mod_fn, *index)


def default_device() -> str:
    """torch 2.15's default (``torch.accelerator.current_accelerator() or "cpu"``) on a torch without
    ``torch.accelerator``."""
    for name in ("cuda", "xpu", "mps"):
        backend = getattr(torch, name, None)
        if backend is not None and hasattr(backend, "is_available") and backend.is_available():
            return name
    return "cpu"


for _function in (noop_mask, or_masks, and_masks, create_mask):
    _function.__module__ = _MODULE

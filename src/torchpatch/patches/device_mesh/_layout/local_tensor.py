"""The pieces of torch 2.15's ``torch.distributed._local_tensor`` that code outside LocalTensor uses:
the rank-list-to-layout inference and the no-op guards for an active ``LocalTensorMode``."""

from __future__ import annotations

import contextlib
import math
from functools import reduce
from typing import Any, List, Optional, Tuple


def _indices_to_layout(indices: List[int]) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The (shape, stride) of a sorted, unique rank list read as a regular grid, outer modes first;
    ``((), ())`` for at most one rank."""
    if len(indices) <= 1:
        return (), ()
    stride = reduce(math.gcd, (b - a for a, b in zip(indices, indices[1:])))
    if stride == 0:
        raise AssertionError("Cannot determine stride; indices may not be unique.")
    present = set(indices)
    row_starts = [i for n, i in enumerate(indices) if n == 0 or i - stride not in present]
    if len(indices) % len(row_starts):
        raise AssertionError(
            "Indices do not form a regular grid. "
            f"Found {len(row_starts)} subgroups for {len(indices)} total elements.")
    outer_shape, outer_stride = _indices_to_layout(row_starts)
    return outer_shape + (len(indices) // len(row_starts),), outer_stride + (stride,)


def local_tensor_mode() -> Optional[Any]:
    """The active ``LocalTensorMode``: always ``None``, this torch has no LocalTensor."""
    return None


def maybe_disable_local_tensor_mode() -> contextlib.AbstractContextManager:
    """A context that disables the active ``LocalTensorMode``: none can be active here, so a no-op."""
    return contextlib.nullcontext()

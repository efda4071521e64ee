"""Torch 2.15's ``torch.distributed._mesh_layout``: :class:`_FlatLayout`, the canonical rank layout of
one device-mesh axis, and :class:`_MeshLayout`, a mesh's sequence of them.

Ranks are laid out lexicographically (the last mode varies fastest), as in the :mod:`.pycute` algebra
they are computed with. Equal rank patterns give equal :class:`_FlatLayout` objects: the shape and
stride are stored coalesced and flat (size-1 modes dropped, contiguous modes merged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Any, Iterator, List, Optional, Sequence, Tuple, Union

from torchpatch.patches.device_mesh._layout.pycute import (
    IntTuple,
    Layout,
    as_tuple,
    coalesce,
    complement,
    composition,
    flatten,
    is_int,
    is_tuple,
    make_layout,
    match_structure,
    suffix_product,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class _FlatLayout:
    """The ranks of one mesh axis, as a coalesced flat (shape, stride) pair; ``()`` for one rank."""

    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    def __init__(self, shape: IntTuple, stride: Optional[IntTuple] = None) -> None:
        if not (is_tuple(shape) or is_int(shape)):
            raise TypeError(f"shape must be a tuple or int, got {type(shape)}")
        stride = suffix_product(shape) if stride is None else stride
        if not (is_tuple(stride) or is_int(stride)):
            raise TypeError(f"stride must be a tuple or int, got {type(stride)}")
        if not match_structure(shape, stride):
            raise ValueError(f"sizes {shape} and strides {stride} don't match")
        canonical = coalesce(Layout(shape, stride))
        flat = (flatten(canonical.shape), flatten(canonical.stride))
        object.__setattr__(self, "shape", () if flat == ((1,), (0,)) else flat[0])
        object.__setattr__(self, "stride", () if flat == ((1,), (0,)) else flat[1])

    def __len__(self) -> int:
        raise RuntimeError("You should never need to know the length of the internal representation of a FlatLayout")

    def __getitem__(self, i: int) -> Any:
        raise RuntimeError("You should never need to index into the internal representation of a FlatLayout")

    def to_pycute(self) -> Layout:
        return Layout(self.shape, self.stride) if self.shape else Layout(1, 0)

    def numel(self) -> int:
        return math.prod(self.shape)

    def composition(self, layout: "_MeshLayout") -> "_MeshLayout":
        """``self ∘ layout``: the ranks of this layout that ``layout``'s indices select, one axis per
        top-level mode of the result."""
        result = composition(self.to_pycute(), layout.to_pycute())
        return _MeshLayout([_FlatLayout(s, d) for s, d in zip(as_tuple(result.shape), as_tuple(result.stride))])

    def complement(self, world_size: int) -> "_FlatLayout":
        """The layout that, as outer modes, completes this one to ``world_size`` ranks."""
        result = complement(self.to_pycute(), world_size)
        return _FlatLayout(result.shape, result.stride)

    def all_ranks_from_zero(self) -> List[int]:
        """Every rank of the layout from offset 0, in lexicographic coordinate order."""
        return [sum(c * d for c, d in zip(coord, self.stride)) for coord in product(*map(range, self.shape))]

    def global_ranks(self, world_size: int) -> List[List[int]]:
        """The rank groups that tile ``world_size`` ranks with this layout: one per complement offset."""
        ranks = self.all_ranks_from_zero()
        return [[offset + r for r in ranks] for offset in self.complement(world_size).all_ranks_from_zero()]

    def check_sorted(self) -> bool:
        return tuple(sorted(self.stride, reverse=True)) == self.stride

    def check_orthogonal(self) -> bool:
        """Whether no two coordinates give the same rank (each mode's stride clears the span of the
        modes with smaller strides)."""
        if len(self.shape) < 2:
            return True
        modes = sorted(zip(self.stride, self.shape), reverse=True)
        return all(d % (inner_d * inner_s) == 0 for (d, _), (inner_d, inner_s) in zip(modes, modes[1:]))

    @property
    def sizes_and_strides(self) -> Iterator[Tuple[int, int]]:
        return zip(self.shape, self.stride)


@dataclass(frozen=True)
class _MeshLayout(Sequence[_FlatLayout]):
    """A device mesh's layout: one :class:`_FlatLayout` per mesh dimension."""

    axes: Tuple[_FlatLayout, ...]

    def __init__(self, axes: Sequence[_FlatLayout]) -> None:
        object.__setattr__(self, "axes", tuple(axes))

    @classmethod
    def from_sizes_strides(cls, sizes: Tuple[int, ...], strides: Optional[Tuple[int, ...]] = None) -> "_MeshLayout":
        strides = flatten(suffix_product(sizes)) if strides is None else strides
        if len(sizes) != len(strides):
            raise ValueError(f"sizes and strides must have the same length, got {len(sizes)} and {len(strides)}")
        return cls(tuple(_FlatLayout((s,), (d,)) for s, d in zip(sizes, strides)))

    def __len__(self) -> int:
        return len(self.axes)

    def __getitem__(self, i: Union[int, slice]) -> Any:
        return _MeshLayout(self.axes[i]) if isinstance(i, slice) else self.axes[i]

    def __iter__(self) -> Iterator[_FlatLayout]:
        return iter(self.axes)

    def to_pycute(self) -> Layout:
        return make_layout(*(a.to_pycute() for a in self.axes)) if self.axes else Layout(1, 0)

    @property
    def top_level_sizes(self) -> Tuple[int, ...]:
        return tuple(a.numel() for a in self.axes)

    def numel(self) -> int:
        return math.prod(self.top_level_sizes)

    def cosize(self) -> int:
        return self.to_pycute().cosize()

    def collapse(self) -> _FlatLayout:
        """All axes as one coalesced :class:`_FlatLayout` (the mesh's dimensions forgotten)."""
        return _FlatLayout(tuple(a.shape for a in self.axes), tuple(a.stride for a in self.axes))

    def splice(self, start: int, end: int, layout: "_MeshLayout") -> "_MeshLayout":
        """``self[:start] + layout + self[end:]``."""
        return _MeshLayout(self.axes[:start] + tuple(layout.axes) + self.axes[end:])

    def remap_to_tensor(self, rank_map: "torch.Tensor") -> "torch.Tensor":
        """The ranks of ``rank_map`` (1-D, contiguous) that this layout selects, shaped
        ``(-1, *top_level_sizes)``: one mesh per offset of the complement layout."""
        if rank_map.ndim != 1 or not rank_map.is_contiguous() or rank_map.numel() < self.cosize():
            raise AssertionError
        flat = self.collapse()
        outer = flat.complement(rank_map.numel())
        return rank_map.as_strided(outer.shape + flat.shape, outer.stride + flat.stride).reshape(
            -1, *self.top_level_sizes
        )

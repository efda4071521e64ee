"""The CuTe layout algebra of torch 2.15's ``torch.distributed._pycute``, lexicographic as torch's is
(the last mode varies fastest), for the integer bookkeeping of device-mesh ranks.

An ``IntTuple`` is an int or a (nested) tuple of them; a :class:`Layout` maps a coordinate (or a flat
index) to ``sum(coord * stride)``. Served: the int-tuple helpers (``slice_``, ``crd2crd``,
``shape_div``, ``elem_scale`` ... included), :class:`Layout` (call with coordinates or an index,
indexing, ``size``, ``cosize``), ``make_layout``, ``size``, ``cosize``, ``coalesce``, ``filter``,
``composition``, ``complement``, the inverses, the logical/zipped/tiled divides and products,
``slice_and_offset``. Not served (device meshes never use it): calling a layout with ``None`` coordinates.
"""

from __future__ import annotations

import math
from abc import ABC
from typing import Any, Iterable, List, Optional, Tuple, Union

IntTuple = Union[int, Tuple[Any, ...]]


class Integer(ABC):  # noqa: B024 - a virtual base: ints, not bools nor floats
    @classmethod
    def __subclasshook__(cls, c: type) -> bool:
        return c not in (bool, float) and issubclass(c, int)


def is_int(x: object) -> bool:
    return isinstance(x, Integer)


def is_tuple(x: object) -> bool:
    return isinstance(x, tuple)


def as_tuple(x: IntTuple) -> Tuple[IntTuple, ...]:
    return (x,) if is_int(x) else x


def match_structure(a: IntTuple, b: IntTuple) -> bool:
    """Whether ``a`` and ``b`` nest the same way (ints match ints)."""
    if is_tuple(a) and is_tuple(b):
        return len(a) == len(b) and all(map(match_structure, a, b))
    return is_int(a) and is_int(b)


def flatten(t: IntTuple) -> Tuple[int, ...]:
    return tuple(i for a in t for i in flatten(a)) if is_tuple(t) else (t,)


def product(a: IntTuple) -> int:
    return math.prod(product(x) for x in a) if is_tuple(a) else a


def suffix_product(a: IntTuple, init: IntTuple = 1) -> IntTuple:
    """Row-major (lexicographic) strides of shape ``a``, the last mode's being ``init``."""
    if not is_tuple(a):
        if is_tuple(init):
            raise AssertionError("Invalid combination: int with tuple init")
        return init
    if is_tuple(init):
        if len(a) != len(init):
            raise AssertionError
        return tuple(map(suffix_product, a, init))
    out: List[IntTuple] = []
    for mode in reversed(a):
        out.append(suffix_product(mode, init))
        init = init * product(mode)
    return tuple(reversed(out))


def idx2crd(idx: IntTuple, shape: IntTuple, stride: Optional[IntTuple] = None) -> IntTuple:
    """The coordinate of flat index ``idx`` in ``shape`` (row-major unless ``stride`` is given)."""
    stride = suffix_product(shape) if stride is None else stride
    if is_tuple(shape) and is_tuple(stride):
        if len(shape) != len(stride) or (is_tuple(idx) and len(idx) != len(shape)):
            raise AssertionError
        idxs = idx if is_tuple(idx) else (idx,) * len(shape)
        return tuple(map(idx2crd, idxs, shape, stride))
    if is_tuple(idx) or is_tuple(shape) or is_tuple(stride):
        raise AssertionError("Invalid combination of tuples and ints")
    return (idx // stride) % shape


def crd2idx(crd: Optional[IntTuple], shape: IntTuple, stride: Optional[IntTuple] = None) -> int:
    """``sum(coord * stride)``; an int ``crd`` is first read as a row-major index into ``shape``."""
    stride = suffix_product(shape) if stride is None else stride
    if is_tuple(crd):
        if not (is_tuple(shape) and is_tuple(stride)):
            raise AssertionError(f"Invalid combination: crd={crd}, shape={shape}")
        if not len(crd) == len(shape) == len(stride):
            raise AssertionError
        return sum(map(crd2idx, crd, shape, stride))
    crd = 0 if crd is None else crd
    if not is_tuple(shape):
        if is_tuple(stride):
            raise AssertionError
        return crd * stride
    if len(shape) != len(stride):
        raise AssertionError
    result = 0
    for i in range(len(shape) - 1, 0, -1):
        crd, rest = divmod(crd, product(shape[i]))
        result += crd2idx(rest, shape[i], stride[i])
    return result + (crd2idx(crd, shape[0], stride[0]) if shape else 0)


def signum(a: int) -> int:
    return bool(a > 0) - bool(a < 0)


def inner_product(a: IntTuple, b: IntTuple) -> int:
    """``sum(x * y)`` over matching leaves of ``a`` and ``b`` (same nesting)."""
    if is_tuple(a) and is_tuple(b):
        if len(a) != len(b):
            raise AssertionError
        return sum(map(inner_product, a, b))
    if is_tuple(a) or is_tuple(b):
        raise AssertionError
    return a * b


def tuple_max(a: IntTuple) -> int:
    return max(map(tuple_max, a)) if is_tuple(a) else a


def elem_scale(a: IntTuple, b: IntTuple) -> IntTuple:
    """``a`` scaled leaf by leaf by ``b`` (an int ``a`` by ``b``'s product)."""
    if is_tuple(a):
        if not is_tuple(b):
            raise AssertionError("Invalid combination: tuple with int")
        if len(a) != len(b):
            raise AssertionError
        return tuple(map(elem_scale, a, b))
    return elem_scale(a, product(b)) if is_tuple(b) else a * b


def shape_div(a: IntTuple, b: IntTuple) -> IntTuple:
    """``a`` divided by ``b``, mode by mode (an int ``b`` divides ``a``'s modes left to right)."""
    if is_tuple(a):
        if is_tuple(b):
            if len(a) != len(b):
                raise AssertionError
            return tuple(map(shape_div, a, b))
        out = []
        for mode in a:
            out.append(shape_div(mode, b))
            b = shape_div(b, product(mode))
        return tuple(out)
    if is_tuple(b):
        return shape_div(a, product(b))
    if not (a % b == 0 or b % a == 0):
        raise AssertionError
    return (a + b - 1) // b


def crd2crd(crd: IntTuple, dst_shape: IntTuple, src_shape: Optional[IntTuple] = None) -> IntTuple:
    """Coordinate ``crd`` (of ``src_shape``) as a coordinate of ``dst_shape``."""
    if is_tuple(crd):
        if is_tuple(dst_shape):
            if len(crd) != len(dst_shape):
                raise AssertionError
            return tuple(crd2crd(x, y) for x, y in zip(crd, dst_shape))
        if src_shape is None:
            raise AssertionError
        return crd2idx(crd, src_shape)
    if is_tuple(dst_shape):
        return idx2crd(crd, dst_shape)
    if crd >= dst_shape:
        raise AssertionError
    return crd


def slice_(crd: Union[Tuple[Any, ...], int, None], trg: Union[Tuple[Any, ...], int]) -> Union[Tuple[Any, ...], int]:
    """The modes of ``trg`` where ``crd`` is ``None``, flattened one level."""
    if is_tuple(crd):
        if not is_tuple(trg):
            raise AssertionError("Invalid combination: tuple crd with int trg")
        if len(crd) != len(trg):
            raise AssertionError
        return tuple(m for part in (slice_(c, s) for c, s in zip(crd, trg)) if part != () for m in part)
    return (trg,) if crd is None else ()


def has_none(a: Union[Tuple[Any, ...], int, None]) -> bool:
    return any(map(has_none, a)) if is_tuple(a) else a is None


class LayoutBase:
    pass


def is_layout(x: object) -> bool:
    return isinstance(x, LayoutBase)


class Layout(LayoutBase):
    """A (shape, stride) pair of congruent int-tuples; stride defaults to row-major."""

    def __init__(self, _shape: IntTuple, _stride: Optional[IntTuple] = None) -> None:
        self.shape = _shape
        self.stride = suffix_product(_shape) if _stride is None else _stride

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self.shape, self.stride) == (other.shape, other.stride)

    def __len__(self) -> int:
        return len(self.shape) if is_tuple(self.shape) else 1

    def __call__(self, *args: Any) -> int:
        """The index of a coordinate (or of a flat index) of this layout."""
        if any(a is None or (is_tuple(a) and None in flatten(a)) for a in args):
            raise NotImplementedError("torchpatch's _pycute does not slice layouts with None coordinates")
        return crd2idx(args[0] if len(args) == 1 else args, self.shape, self.stride)

    def __getitem__(self, i: int) -> "Layout":
        if is_tuple(self.shape):
            return Layout(self.shape[i], self.stride[i])
        if i != 0:
            raise AssertionError
        return Layout(self.shape, self.stride)

    def size(self) -> int:
        return product(self.shape)

    def cosize(self) -> int:
        return self(self.size() - 1) + 1

    def __str__(self) -> str:
        return f"{self.shape}:{self.stride}"

    def __repr__(self) -> str:
        return f"Layout({self.shape},{self.stride})"


def make_layout(*layouts: Any) -> Layout:
    """The layout whose modes are ``layouts`` (or the one iterable of layouts given)."""
    if len(layouts) == 1 and not is_layout(layouts[0]):
        layouts = tuple(layouts[0])
    return Layout(tuple(a.shape for a in layouts), tuple(a.stride for a in layouts))


def size(layout: Union[Layout, IntTuple]) -> int:
    return layout.size() if is_layout(layout) else product(layout)


def cosize(layout: Layout) -> int:
    return layout.cosize()


def _from_modes(shape: List[int], stride: List[int]) -> Layout:
    return Layout(shape[0], stride[0]) if len(shape) == 1 else Layout(tuple(shape), tuple(stride))


def _by_profile(op: Any, layout: Layout, profile: Tuple[Any, ...]) -> Layout:
    if len(layout) < len(profile):
        raise AssertionError
    modes = [op(layout[i], p) for i, p in enumerate(profile)]
    return make_layout(modes + [layout[i] for i in range(len(profile), len(layout))])


def coalesce(layout: Layout, profile: Any = None) -> Layout:
    """The same function with size-1 modes dropped and contiguous neighbours merged, flat."""
    if is_tuple(profile):
        return _by_profile(coalesce, layout, profile)
    shape, stride = [1], [0]  # built from the last (fastest) mode backwards
    for s, d in zip(reversed(flatten(layout.shape)), reversed(flatten(layout.stride))):
        if s == 1:
            continue
        if shape[-1] == 1:
            shape[-1], stride[-1] = s, d
        elif shape[-1] * stride[-1] == d:
            shape[-1] *= s
        else:
            shape.append(s)
            stride.append(d)
    return _from_modes(shape[::-1], stride[::-1])


def filter(layout: Layout, profile: Any = None) -> Layout:  # noqa: A001 - torch's name
    """:func:`coalesce` after dropping stride-0 modes too."""
    if is_tuple(profile):
        return _by_profile(filter, layout, profile)
    modes = [(s, d) for s, d in zip(flatten(layout.shape), flatten(layout.stride)) if s != 1 and d != 0]
    if not modes:
        return Layout(1, 0)
    return coalesce(Layout(tuple(s for s, _ in modes), tuple(d for _, d in modes)))


def composition(layout_a: Layout, layout_b: Any) -> Layout:
    """``layout_a ∘ layout_b``: ``layout_b``'s indices read through ``layout_a``."""
    if layout_b is None:
        return layout_a
    if is_int(layout_b):
        return composition(layout_a, Layout(layout_b))
    if is_tuple(layout_b):
        return _by_profile(composition, layout_a, layout_b)
    if is_tuple(layout_b.shape):
        return make_layout(composition(layout_a, mode) for mode in _modes(layout_b))
    if layout_b.stride == 0:
        return Layout(layout_b.shape, 0)
    rest_shape, rest_stride = layout_b.shape, layout_b.stride
    flat_a = coalesce(layout_a)
    a_shape, a_stride = flatten(flat_a.shape), flatten(flat_a.stride)
    shape: List[int] = []
    stride: List[int] = []
    for s, d in zip(reversed(a_shape[1:]), reversed(a_stride[1:])):  # fastest modes first
        if s % rest_stride and rest_stride % s:
            raise AssertionError
        kept = min(max(1, s // rest_stride), rest_shape)
        if kept != 1:
            shape.append(kept)
            stride.append(rest_stride * d)
        rest_shape //= kept
        rest_stride = -(-rest_stride // s)  # ceiling division, sign kept
    if rest_shape != 1 or not shape:
        shape.append(rest_shape)
        stride.append(rest_stride * a_stride[0])
    return _from_modes(shape[::-1], stride[::-1])


def _modes(layout: Layout) -> Iterable[Layout]:
    return (layout[i] for i in range(len(layout)))


def complement(layout: Union[Layout, IntTuple], max_idx: int = 1) -> Layout:
    """The layout of the indices up to ``max_idx`` that ``layout`` does not reach, as its outer modes."""
    if is_int(layout):
        return complement(Layout(layout))
    shape: List[int] = []
    stride: List[int] = []
    current = 1
    for d, s in sorted(zip(flatten(layout.stride), flatten(layout.shape))):
        if d == 0 or s == 1:
            continue
        in_bound = current <= s * d
        if type(in_bound) is bool and not in_bound:
            raise AssertionError
        shape.append(d // current)
        stride.append(current)
        current = s * d
    shape.append(-(-max_idx // current))
    stride.append(current)
    return coalesce(Layout(tuple(shape[::-1]), tuple(stride[::-1])))


def right_inverse(layout: Union[Layout, IntTuple, None]) -> Optional[Layout]:
    """The layout R with ``layout(R(i)) == i`` over the largest contiguous prefix of ``layout``'s image."""
    if layout is None:
        return None
    if is_int(layout):
        return Layout(layout)
    shape: List[int] = []
    stride: List[int] = []
    current = 1
    flat_shape = flatten(layout.shape)
    for mode_stride, mode_shape, rstride in sorted(zip(flatten(layout.stride), flat_shape,
                                                       flatten(suffix_product(flat_shape)))):
        if mode_shape == 1:
            continue
        if current != mode_stride:
            break
        shape.append(mode_shape)
        stride.append(rstride)
        current = mode_shape * mode_stride
    return coalesce(Layout(tuple(reversed(shape)), tuple(reversed(stride))))


def left_inverse(layout: Union[Layout, IntTuple, None]) -> Optional[Layout]:
    """The layout L with ``L(layout(i)) == i``."""
    if layout is None:
        return None
    if is_int(layout):
        return Layout(layout)
    return right_inverse(make_layout(complement(layout), layout))


def _by_modes(op: Any, layout_a: Layout, layout_b: Tuple[Any, ...]) -> Layout:
    """``op`` applied mode by mode over ``layout_b``'s modes; ``layout_a``'s further modes kept."""
    if len(layout_a) < len(layout_b):
        raise AssertionError
    return make_layout([op(layout_a[i], layout_b[i]) for i in range(len(layout_b))]
                       + [layout_a[i] for i in range(len(layout_b), len(layout_a))])


def logical_divide(layout_a: Layout, layout_b: Any) -> Layout:
    """``layout_a`` split into tiles of ``layout_b`` and the rest."""
    if layout_b is None:
        return layout_a
    if is_int(layout_b):
        return logical_divide(layout_a, Layout(layout_b))
    if is_tuple(layout_b):
        return _by_modes(logical_divide, layout_a, layout_b)
    return composition(layout_a, make_layout(layout_b, complement(layout_b, size(layout_a))))


def logical_product(layout_a: Layout, layout_b: Any) -> Layout:
    """``layout_a`` repeated as ``layout_b`` says (an int ``layout_b``: divided, as torch 2.15 does)."""
    if layout_b is None:
        return layout_a
    if is_int(layout_b):
        return logical_divide(layout_a, Layout(layout_b))
    if is_tuple(layout_b):
        return _by_modes(logical_product, layout_a, layout_b)
    return make_layout(layout_a, composition(complement(layout_a, size(layout_a) * cosize(layout_b)), layout_b))


def _hier_unzip(splitter: Any, layout_a: Layout, layout_b: Any) -> Layout:
    if layout_b is None:
        return make_layout(Layout(1, 0), layout_a)
    if is_tuple(layout_b):
        if len(layout_a) < len(layout_b):
            raise AssertionError
        split = make_layout([_hier_unzip(splitter, layout_a[i], layout_b[i]) for i in range(len(layout_b))])
        return make_layout(make_layout([split[i][0] for i in range(len(layout_b))]),
                           make_layout([split[i][1] for i in range(len(layout_b))]
                                       + [layout_a[i] for i in range(len(layout_b), len(layout_a))]))
    return splitter(layout_a, layout_b)


def zipped_divide(layout_a: Layout, layout_b: Any) -> Layout:
    return _hier_unzip(logical_divide, layout_a, layout_b)


def tiled_divide(layout_a: Layout, layout_b: Any) -> Layout:
    result = zipped_divide(layout_a, layout_b)
    return make_layout([result[0]] + [result[1][i] for i in range(len(result[1]))])


def zipped_product(layout_a: Layout, layout_b: Any) -> Layout:
    return _hier_unzip(logical_product, layout_a, layout_b)


def tiled_product(layout_a: Layout, layout_b: Any) -> Layout:
    result = zipped_product(layout_a, layout_b)
    return make_layout([result[0]] + [result[1][i] for i in range(len(result[1]))])


def slice_and_offset(crd: Tuple[Any, ...], layout: Layout) -> Tuple[Layout, int]:
    """The sub-layout of ``layout``'s modes where ``crd`` is None, and the offset of ``crd``'s other coordinates."""
    return Layout(slice_(crd, layout.shape), slice_(crd, layout.stride)), crd2idx(crd, layout.shape, layout.stride)

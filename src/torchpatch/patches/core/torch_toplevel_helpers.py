"""torch-toplevel-helpers: ``torch._check`` and its kin, ``torch.sym_max``/``sym_min``/``sym_not``/
``sym_float``/``sym_int`` and ``torch.unravel_index`` on torch 1.13-2.1; ``torch.newaxis`` on torch 1.13-2.3.

What breaks:   model code written for torch 2 states its shape assumptions with ``torch._check(cond,
               lambda: msg)`` (``_check_index``, ``_check_value``, ... for other error types), and
               computes sizes with ``torch.sym_max``/``sym_min`` so that they stay traceable; on torch
               1.13 the first such line dies with ``AttributeError: module 'torch' has no attribute
               '_check'``. Code that turns flat indices (``topk`` over a flattened grid) into coordinates
               with ``torch.unravel_index`` fails the same way on 1.13 and 2.1, and array-API code that
               indexes with ``x[:, torch.newaxis]`` on 1.13-2.3.
Torch:         the checks and ``sym_*`` functions arrived in 2.1 (with symbolic shapes: on 2.15 they
               accept a ``SymBool``/``SymInt`` as well as plain values), ``unravel_index`` in 2.2,
               ``newaxis`` in 2.4.
Fix:           set them on torch, with torch 2.15's semantics for every value torch 1.13 can give
               them (it has no symbolic values): a false ``cond`` raises the check's error type with
               the message (a callable is called; ``None`` gives torch's default text); a ``cond``
               that is not a bool raises torch's ``TypeError``; ``_check_tensor_all`` requires a bool
               tensor and checks all its elements. ``sym_max``/``sym_min`` promote to float when
               either argument is a float and reject other types with torch's ``AssertionError``;
               tensor subclasses' ``__torch_function__`` is honoured as on 2.15. ``newaxis`` is
               ``None``. ``unravel_index(indices, shape)`` gives one int64 coordinate tensor per dimension
               (floor division and remainder by the shape's strides), with torch's errors for a
               non-integer ``indices``, a non-int shape, negative sizes, and a zero size with indices.
               Names are set as plain attributes (a module ``__getattr__`` would slow every
               ``torch.X`` lookup on torch 1.13), only where torch lacks them.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/__init__.py (``_check_with``,
               ``sym_max``, ``newaxis``); torch/functional.py (``unravel_index``)
"""

from __future__ import annotations

import builtins
import itertools
import operator
import sys
from types import ModuleType
from typing import Any, Callable, Sequence, Tuple, Type, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="torch-toplevel-helpers",
    summary="torch.newaxis; torch.unravel_index (1.13-2.1); torch._check (and _check_index/_value/_type/"
            "_not_implemented/_with/_tensor_all), torch.sym_max/sym_min/sym_not/sym_float/sym_int (1.13)",
    torch="<2.4",
    upstream="https://github.com/pytorch/pytorch/blob/v2.15.0/torch/__init__.py",
    behaviour="torch._check* and sym_* (plain values, 2.15's semantics), torch.newaxis = None, torch.unravel_index, "
              "where missing",
)

Message = Union[str, Callable[[], object], None]
_DEFAULT = ("Expected cond to be True, but got False. (Could this error message be improved? If so, please "
            "report an enhancement request to PyTorch.)")


def _check_with(error_type: Type[BaseException], cond: bool, message: Message) -> None:
    if not isinstance(cond, builtins.bool):
        import torch

        if isinstance(cond, torch.Tensor):
            raise TypeError("cond must be a bool, but got a Tensor. For tensor conditions, use "
                            "torch._check_tensor_all() to assert that all elements are true.")
        raise TypeError(f"cond must be a bool, but got {type(cond)}")
    if cond:
        return
    if not issubclass(error_type, Exception) or issubclass(error_type, Warning):
        raise AssertionError(f"error_type must be a subclass of Exception but not Warning, got {error_type}")
    raise error_type(_DEFAULT if message is None else str(message() if callable(message) else message))


def _check(cond: bool, message: Message = None) -> None:
    """Raise ``RuntimeError`` with ``message`` unless ``cond``."""
    _check_with(RuntimeError, cond, message)


def _check_index(cond: bool, message: Message = None) -> None:
    """Raise ``IndexError`` with ``message`` unless ``cond``."""
    _check_with(IndexError, cond, message)


def _check_value(cond: bool, message: Message = None) -> None:
    """Raise ``ValueError`` with ``message`` unless ``cond``."""
    _check_with(ValueError, cond, message)


def _check_type(cond: bool, message: Message = None) -> None:
    """Raise ``TypeError`` with ``message`` unless ``cond``."""
    _check_with(TypeError, cond, message)


def _check_not_implemented(cond: bool, message: Message = None) -> None:
    """Raise ``NotImplementedError`` with ``message`` unless ``cond``."""
    _check_with(NotImplementedError, cond, message)


def _check_tensor_all_with(error_type: Type[BaseException], cond: Any, message: Message = None) -> None:
    import torch

    if not torch.is_tensor(cond):
        raise TypeError(f"cond must be a tensor, but got {type(cond)}")
    if not cond.dtype == torch.bool:
        raise TypeError(f"cond tensor must have dtype torch.bool, but got {cond.dtype}")
    _check_with(error_type, builtins.bool(cond.all().item()), message)


def _check_tensor_all(cond: Any, message: Message = None) -> None:
    """Raise ``RuntimeError`` with ``message`` unless every element of the bool tensor ``cond`` is true."""
    _check_tensor_all_with(RuntimeError, cond, message)


def _torch_function(fn: Callable[..., Any], args: Tuple[Any, ...]) -> Tuple[bool, Any]:
    from torch import overrides

    if overrides.has_torch_function(args):
        return True, overrides.handle_torch_function(fn, args, *args)
    return False, None


def sym_not(a: Any) -> Any:
    """Logical negation (``~a`` for a sympy expression, ``a.__sym_not__()`` where defined)."""
    handled, out = _torch_function(sym_not, (a,))
    if handled:
        return out
    if hasattr(a, "__sym_not__"):
        return a.__sym_not__()
    sympy = sys.modules.get("sympy")
    if sympy is not None and isinstance(a, sympy.Basic):
        return ~a
    return not a


def sym_float(a: Any) -> Any:
    """``float(a)`` (``a.__sym_float__()`` where defined)."""
    handled, out = _torch_function(sym_float, (a,))
    if handled:
        return out
    if hasattr(a, "__sym_float__"):
        return a.__sym_float__()
    return builtins.float(a)


def sym_int(a: Any) -> Any:
    """``int(a)``."""
    handled, out = _torch_function(sym_int, (a,))
    return out if handled else builtins.int(a)


def __all_and_float_types() -> Tuple[Tuple[type, ...], Tuple[type, ...]]:
    try:
        import numpy as np

        return (np.integer, np.floating, builtins.int, builtins.float), (np.floating, builtins.float)
    except ModuleNotFoundError:
        return (builtins.int, builtins.float), (builtins.float,)


def _extreme(pick: Callable[[Any, Any], Any], fn: Callable[..., Any], a: Any, b: Any) -> Any:
    handled, out = _torch_function(fn, (a, b))
    if handled:
        return out
    all_types, float_types = __all_and_float_types()
    for value in (a, b):
        if not isinstance(value, all_types):
            raise AssertionError(f"expected {all_types}, got {type(value)}")
    if isinstance(a, float_types) or isinstance(b, float_types):
        return builtins.float(pick(a, b))
    return pick(a, b)


def sym_max(a: Any, b: Any) -> Any:
    """``max(a, b)`` of two ints or floats, a float if either is one."""
    return _extreme(builtins.max, sym_max, a, b)


def sym_min(a: Any, b: Any) -> Any:
    """``min(a, b)`` of two ints or floats, a float if either is one."""
    return _extreme(builtins.min, sym_min, a, b)


def unravel_index(indices: Any, shape: Any) -> Tuple[Any, ...]:
    """The coordinates, one tensor per dimension of ``shape``, of each flat index in ``indices``."""
    import torch
    from torch import overrides

    if overrides.has_torch_function_unary(indices):
        return overrides.handle_torch_function(unravel_index, (indices,), indices, shape=shape)
    _check_type(not indices.is_complex() and not indices.is_floating_point() and indices.dtype != torch.bool,
                lambda: f"expected 'indices' to be integer dtype, but got {indices.dtype}")
    _check_type(isinstance(shape, (int, Sequence)),
                lambda: f"expected 'shape' to be int or sequence of ints, but got {type(shape)}")
    if isinstance(shape, int):
        shape = torch.Size([shape])
    else:
        for dim in shape:
            _check_type(isinstance(dim, int),
                        lambda: f"expected 'shape' sequence to only contain ints, but got {type(dim)}")
        shape = torch.Size(shape)
    _check_value(all(dim >= 0 for dim in shape), lambda: f"'shape' cannot have negative values, but got {tuple(shape)}")
    _check_value(all(dim > 0 for dim in shape) or indices.numel() == 0,
                 lambda: f"'shape' cannot have zero dimensions when 'indices' is non-empty, but got {tuple(shape)}")
    strides = list(reversed(list(itertools.accumulate(reversed(list(shape[1:]) + [1]), func=operator.mul))))
    as_tensor = {"device": indices.device, "dtype": torch.int64}
    coordinates = torch.div(indices.unsqueeze(-1), torch.tensor(strides, **as_tensor), rounding_mode="floor")
    return (coordinates % torch.tensor(shape, **as_tensor)).unbind(-1)


CHECKS = {f.__name__: f for f in (_check, _check_with, _check_index, _check_value, _check_type, _check_not_implemented,
                                  _check_tensor_all, _check_tensor_all_with, sym_not, sym_float, sym_int, sym_max,
                                  sym_min)}
NEWAXIS = {"newaxis": None, "__all_and_float_types": __all_and_float_types}
PATCH.sets("torch", tuple(CHECKS), torch="<2.1")
PATCH.sets("torch", ("unravel_index",), torch="<2.2")
PATCH.sets("torch", tuple(NEWAXIS))
NAMES = {**CHECKS, "unravel_index": unravel_index, **NEWAXIS}


@PATCH.on_import("torch")
def set_helpers(patcher: Patcher, torch: ModuleType) -> bool:
    missing = {name: value for name, value in NAMES.items() if name not in vars(torch)}
    for name, value in missing.items():
        patcher.setattr(torch, name, value)
    return bool(missing)

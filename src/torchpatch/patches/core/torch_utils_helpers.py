"""torch-utils-helpers: ``torch._utils.is_compiling``, ``cpu_count``, ``try_import`` and ``_dummy_type``,
torch 1.13-2.0.

What breaks:   libraries written for torch 2 reach for these private helpers of ``torch._utils`` (whether
               torch.compile is tracing; the CPUs this process may use, for worker counts; an optional
               import; a placeholder base class for a backend that is not built) and die on torch 1.13
               with ``AttributeError: module 'torch._utils' has no attribute ...``.
Torch:         ``is_compiling`` came with torch.compile (2.0/2.1), the other three later; none needs
               more than Python and ``os``.
Fix:           serve them as torch 2.15 computes them: ``is_compiling()`` warns that it is deprecated
               (as 2.15 does) and returns False, as torch 2.15 does outside torch.compile, which torch
               1.13 does not have; ``cpu_count()`` counts the CPUs of ``os.sched_getaffinity`` where
               the platform has it, else ``os.cpu_count()``; ``try_import(name)`` returns the module
               from ``sys.modules``, else imports it when it can be found, else None;
               ``_dummy_type(name)`` makes a class whose construction raises torch's
               ``RuntimeError``.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/_utils.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Optional

from torchpatch import Patch

PATCH = Patch(
    id="torch-utils-helpers",
    summary="torch._utils.is_compiling, cpu_count, try_import, _dummy_type",
    torch="<2.1",
    upstream="https://github.com/pytorch/pytorch/blob/v2.15.0/torch/_utils.py",
)

MODULE = "torch._utils"


def is_compiling() -> bool:
    """Whether torch.compile is tracing: never, on a torch without it (deprecated, as on 2.15)."""
    warnings.warn("`torch._utils.is_compiling` is deprecated. Use `torch.compiler.is_compiling` instead.",
                  stacklevel=2)
    return False


def cpu_count() -> Optional[int]:
    """The number of CPUs available to this process."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def try_import(module_name: str) -> Optional[ModuleType]:
    """The module, imported if it can be found, else None."""
    module = sys.modules.get(module_name, None)
    if module is not None:
        return module
    spec = importlib.util.find_spec(module_name)
    if spec is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    if spec.loader is None:
        raise AssertionError("The loader attribute should always be set")
    spec.loader.exec_module(module)
    return module


def _dummy_type(name: str) -> type:
    """A class named ``name`` that cannot be instantiated."""

    def refuse(is_init: bool) -> Callable[..., Any]:
        def error(obj: Any, *args: Any, **kwargs: Any) -> None:
            class_name = obj.__class__.__name__ if is_init else obj.__name__
            raise RuntimeError(f"Tried to instantiate dummy base class {class_name}")

        return error

    return type(name, (object,), {"__init__": refuse(True), "__new__": refuse(False)})


for _function in (is_compiling, cpu_count, try_import, _dummy_type):
    PATCH.symbol(MODULE, _function.__name__)(lambda _function=_function: _function)

"""flash-attention-registry: torch 2.11's flash attention implementation registry
(``register_flash_attention_impl``, ``activate_flash_attention_impl``, ``list_flash_attention_impls``,
``current_flash_attention_impl``, ``restore_flash_attention_impl``) on torch 2.4-2.10.

What breaks:   code written for torch 2.11+ that selects a flash attention implementation dies on
               older torch: ``ImportError: cannot import name 'activate_flash_attention_impl' from
               'torch.nn.attention'`` (2.4-2.9), ``... 'restore_flash_attention_impl'`` (2.10).
Torch:         2.4-2.9 have no registry; 2.10 has it without ``restore_flash_attention_impl`` (its
               state: the active name and a handle per name); 2.11 added restore and FA3.
Fix:           - 2.4-2.9: the registry, served as in torch 2.15: ``register_flash_attention_impl(impl,
                 *, register_fn)`` records the callable; ``activate_flash_attention_impl(impl)``
                 first restores the default (removing the active handle), raises ``ValueError``
                 ("Unknown flash attention impl ...") for an unregistered name, then calls
                 ``register_fn()`` and keeps the handle it returns (activation without a handle
                 leaves nothing active); ``list_flash_attention_impls()`` is sorted;
                 ``restore_flash_attention_impl()`` removes the active handle, or logs torch's
                 warning on the ``torch.nn.attention._registry`` logger when there is none.
               - "FA3" and "FA4" are registered, as in torch 2.15. Activating one imports its
                 kernel package first (``flash_attn_interface``, ``flash_attn.cute.interface``),
                 so without the package it raises torch 2.15's own ``ModuleNotFoundError``; with
                 it, after 2.15's checks that the package exposes its kernels, it raises
                 ``RuntimeError``: routing SDPA's flash attention to FA3/FA4 needs the SDPA switch
                 torch 2.11 added in C++ (``torch._C._set_sdp_use_fa3``/``_set_sdp_use_fa4``),
                 which this torch lacks.
               - 2.10: ``restore_flash_attention_impl`` on torch's own registry: removes the active
                 implementation's handle and clears the active name.
Upstream:      https://github.com/pytorch/pytorch/pull/167348 (registry and FA4, torch 2.10);
               https://github.com/pytorch/pytorch/pull/169866 (restore, torch 2.11)
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchpatch import Patch

PATCH = Patch(
    id="flash-attention-registry",
    summary="torch.nn.attention's flash attention implementation registry (activate/list/current/register/"
            "restore_flash_attention_impl; restore alone on 2.10)",
    torch=">=2.4,<2.11",
    upstream="https://github.com/pytorch/pytorch/pull/167348",
)

_MODULE = "torch.nn.attention"
# torch 2.15 logs on its registry module's logger
_LOG = logging.getLogger("torch.nn.attention._registry")
_NO_ACTIVE = "Trying to restore default FA2 impl when no custom impl was activated"

RegisterFn = Callable[..., Any]
_IMPLS: Dict[str, RegisterFn] = {}
_ACTIVE: Optional[Tuple[str, Any]] = None  # (name, handle)


def register_flash_attention_impl(impl: str, *, register_fn: RegisterFn) -> None:
    """Record ``register_fn``, which :func:`activate_flash_attention_impl` calls to install ``impl``."""
    _IMPLS[impl] = register_fn


def activate_flash_attention_impl(impl: str) -> None:
    """Restore the default, then install ``impl`` by calling its ``register_fn``; its handle, if
    any, makes it the active implementation."""
    global _ACTIVE
    restore_flash_attention_impl(_raise_warn=False)
    register_fn = _IMPLS.get(impl)
    if register_fn is None:
        raise ValueError(f"Unknown flash attention impl '{impl}'. "
                         f"Available implementations: {list_flash_attention_impls()}")
    handle = register_fn()
    if handle is not None:
        _ACTIVE = (impl, handle)


def list_flash_attention_impls() -> List[str]:
    """The registered implementations' names, sorted."""
    return sorted(_IMPLS)


def current_flash_attention_impl() -> Optional[str]:
    """The active implementation's name; None for the default (FA2)."""
    return None if _ACTIVE is None else _ACTIVE[0]


def restore_flash_attention_impl(_raise_warn: bool = True) -> None:
    """Remove the active implementation's handle, back to the default FA2."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE[1].remove()
    elif _raise_warn:
        _LOG.warning(_NO_ACTIVE)
    _ACTIVE = None


def _no_sdp_switch(impl: str) -> None:
    import torch

    raise RuntimeError(
        f"{impl} cannot be activated on torch {torch.__version__}: routing scaled_dot_product_attention's flash "
        f"attention to {impl} needs the SDPA switch torch >= 2.11 has in C++ "
        f"(torch._C._set_sdp_use_{impl.lower()}), which this torch lacks")


def register_flash_attention_fa3(module_path: str = "flash_attn_interface") -> None:
    """torch 2.15's FA3 registration: import the kernels, check them, then (here) refuse."""
    import torch

    importlib.import_module(module_path)
    if not hasattr(torch.ops, "flash_attn_3"):
        raise RuntimeError(f"Module '{module_path}' does not expose FA3 kernels")
    for kind, op in (("forward", "fwd"), ("backward", "bwd")):
        if not hasattr(torch.ops.flash_attn_3, op):
            raise RuntimeError(f"Module '{module_path}' does not expose FA3 {kind} kernels")
    _no_sdp_switch("FA3")


def register_flash_attention_fa4(module_path: str = "flash_attn.cute.interface") -> None:
    """torch 2.15's FA4 registration: import the kernels, check them, then (here) refuse."""
    module = importlib.import_module(module_path)
    if not hasattr(module, "_flash_attn_fwd") or not hasattr(module, "_flash_attn_bwd"):
        raise RuntimeError(f"Module '{module_path}' does not expose FA4 kernels")
    _no_sdp_switch("FA4")


register_flash_attention_impl("FA3", register_fn=register_flash_attention_fa3)
register_flash_attention_impl("FA4", register_fn=register_flash_attention_fa4)


def _restore_on_torch_registry(registry: ModuleType) -> Callable[..., None]:
    """torch 2.10's registry keeps the active name and a handle per name: restore works on those."""

    def restore_flash_attention_impl(_raise_warn: bool = True) -> None:
        """Remove the active implementation's handle, back to the default FA2."""
        active = registry._FLASH_ATTENTION_ACTIVE
        handle = registry._FLASH_ATTENTION_HANDLES.pop(active, None) if active is not None else None
        if handle is not None:
            handle.remove()
        elif _raise_warn:
            _LOG.warning(_NO_ACTIVE)
        registry._FLASH_ATTENTION_ACTIVE = None

    return restore_flash_attention_impl


def _served(function: Callable[..., Any]) -> Callable[..., Any]:
    function.__module__ = _MODULE  # as torch 2.15 presents them
    return function


for _function in (register_flash_attention_impl, activate_flash_attention_impl, list_flash_attention_impls,
                  current_flash_attention_impl):
    PATCH.symbol(_MODULE, _function.__name__)(lambda f=_function: _served(f))


@PATCH.symbol(_MODULE, "restore_flash_attention_impl")
def _restore() -> Callable[..., None]:
    registry = importlib.import_module(_MODULE).__dict__.get("_registry")
    if isinstance(registry, ModuleType):  # torch 2.10
        return _served(_restore_on_torch_registry(registry))
    return _served(restore_flash_attention_impl)

"""funcol-view-wait: a view of a functional collective's result at an offset waits for the collective,
torch 2.1-2.3 (legacy Python functional collectives).

What breaks:   ``allx = all_gather_tensor(x.unsqueeze(0), 0, group); y = F.linear(allx[1 - rank].view(...), w)``
               (OpenDiT's ``AsyncAllGatherForTwo``, any slice of an all-gather, reduce-scatter or
               all-reduce result that does not start at its first element) reads the output buffer
               before the collective has finished: on 2 gloo ranks rank 0 gets the buffer's stale or
               uninitialised memory (values like 2.5e+37, inf, nan, or the previous step's data), no
               error, only a "Trying to register finalizer to AsyncCollectiveTensor but the inner tensor
               is already gone" warning. ``trigger_wait()`` and ``repr()`` of such a view do not wait either.
Torch:         torch 2.1 made ``AsyncCollectiveTensor`` pass view ops through without waiting (pytorch
               PR 105240) and re-wrap their results; the legacy registry that pairs a result with its
               ``Work`` (``_functional_collectives_impl.data_ptr_to_work``) is keyed by ``data_ptr()``, so a
               view whose ``data_ptr()`` differs from the buffer's (``allx[1]``, ``allx[:, 2:]``, the second
               ``chunk``) is paired with nothing and its first real use waits for nothing. torch 2.0
               waited on every op, views included. The native functional collectives (C++ registry keyed
               by the storage: views share it) fix it; they are opt-in in 2.2 (``_USE_NATIVE_C10D_FUNCTIONAL``),
               the default in 2.3 (the legacy path, bug included, comes back with
               ``TORCH_DISABLE_NATIVE_FUNCOL=1``), the only path from 2.4 (the legacy registry is gone).
               Reproduced on 2.1.2 (rank 0 wrong in 20 of 20 steps when its peer joins late); right on
               2.4.1, 2.9.0, 2.13.0, 2.14.1, 2.15.0; 2.2/2.3 from the upstream sources (no such venv
               here), hence ``>=2.1,<2.4``, and the hook's behaviour check (a stand-in Work: does
               ``wait_tensor`` go through the legacy registry, does using ``result[1]`` wait) decides.
Fix:           a view op on an ``AsyncCollectiveTensor`` (no wait, as torch does) registers each wrapped
               result's own ``data_ptr()`` with the collective its argument belongs to, as the registry
               already does for a view at the buffer's start: the first non-view use, ``trigger_wait()``,
               ``repr()``, ``wait_tensor()`` of the view then wait for that collective; the view wrapper
               counts as a live alias (the collective is waited when the last wrapper goes). Non-view ops
               are torch's own.
Upstream:      https://github.com/pytorch/pytorch/pull/120370 (native functional collectives by default,
               torch 2.3); https://github.com/pytorch/pytorch/pull/123777 (legacy path removed, torch 2.4);
               the unwaited views came with https://github.com/pytorch/pytorch/pull/105240
"""

from __future__ import annotations

import warnings
import weakref
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="funcol-view-wait",
    summary="views of a functional collective's result at an offset (allx[1]) wait for it, torch 2.1-2.3 legacy funcol",
    torch=">=2.1,<2.4",
    upstream="https://github.com/pytorch/pytorch/pull/120370",
    behaviour="AsyncCollectiveTensor views at an offset wait for their collective",
    category="correctness",
)


class _ProbeWork:
    """A stand-in for a c10d ``Work``: records whether it was waited on."""

    def __init__(self) -> None:
        self.waited = False

    def wait(self) -> bool:
        self.waited = True
        return True


def _has_legacy_registry(impl: ModuleType) -> bool:
    """Whether torch's Python functional collectives pair results with their Work by ``data_ptr()``
    (torch 2.1-2.3; 2.4 keeps only the native, storage-keyed registry)."""
    return isinstance(getattr(impl, "data_ptr_to_work", None), dict) and hasattr(impl, "_register_tensor_work")


def _offset_view_waits(funcol: ModuleType, impl: ModuleType) -> Optional[bool]:
    """Behaviour check on a stand-in Work: None when ``wait_tensor`` does not go through the legacy
    registry (native functional collectives), else whether using ``result[1]`` waits. Leaves the
    module as it found it: its registration counter and its warnings registry."""
    version, had_registry = getattr(impl, "work_version", None), "__warningregistry__" in vars(impl)
    try:
        return _ask(funcol, impl)
    finally:
        if version is not None:
            impl.work_version = version
        if not had_registry:
            vars(impl).pop("__warningregistry__", None)


def _ask(funcol: ModuleType, impl: ModuleType) -> Optional[bool]:
    import torch

    def stand_in() -> Tuple["torch.Tensor", _ProbeWork, Any]:
        buf, work = torch.zeros(2, 2), _ProbeWork()
        impl._register_tensor_work(buf, work)
        return buf, work, impl.data_ptr_to_work[buf.data_ptr()]

    buf, work, registration = stand_in()
    funcol.wait_tensor(buf)
    legacy = work.waited
    registration.wait()  # settles the stand-in's registration whatever wait_tensor did
    if not legacy:
        return None  # wait_tensor goes elsewhere (native funcol): the legacy registry is not in use
    buf, work, registration = stand_in()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "inner tensor is already gone" for the offset view
        result = funcol._maybe_wrap_tensor(buf)
        (result[1] + 0).sum()
    waited = work.waited
    registration.wait()
    return waited


def _view_dispatch(original: Callable[..., Any], funcol: ModuleType, impl: ModuleType) -> classmethod:
    """``AsyncCollectiveTensor.__torch_dispatch__`` whose view ops register their results' pointers."""
    import torch
    from torch.utils._pytree import tree_map_only

    def dispatch(cls: type, func: Any, types: Tuple[type, ...], args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        if not funcol._is_view_op(func):
            return original(func, types, args, kwargs)
        kwargs = kwargs or {}
        source = args[0] if args and isinstance(args[0], cls) else None  # a view op aliases its first argument
        registration = impl.data_ptr_to_work.get(source.elem.data_ptr()) if source is not None else None

        def wrap(t: "torch.Tensor") -> "torch.Tensor":
            wrapper = cls(t)
            ptr = t.data_ptr()
            reg = registration if registration is not None else impl.data_ptr_to_work.get(ptr)
            if reg is not None:  # None: the collective already finished, nothing to wait for
                reg._record_wrapper(ptr)
                weakref.finalize(wrapper, impl._wait_reg_dec, ptr, reg)
            return wrapper

        out = func(*tree_map_only(cls, lambda e: e.elem, args), **tree_map_only(cls, lambda e: e.elem, kwargs))
        return tree_map_only(torch.Tensor, wrap, out)

    return classmethod(dispatch)


@PATCH.on_import("torch.distributed._functional_collectives")
def register_offset_views(patcher: Patcher, funcol: ModuleType) -> bool:
    import sys

    impl = sys.modules.get("torch.distributed._functional_collectives_impl")
    act = getattr(funcol, "AsyncCollectiveTensor", None)
    if impl is None or act is None or not _has_legacy_registry(impl) or not hasattr(funcol, "_is_view_op"):
        return False  # torchpatch's own module (1.13) or native-only functional collectives (2.4+)
    if _offset_view_waits(funcol, impl) is not False:
        return False  # native funcol in use (2.3 default, 2.2 opted in), or views already wait
    original = act.__torch_dispatch__  # bound to the class
    patcher.setattr(act, "__torch_dispatch__", _view_dispatch(original, funcol, impl))
    if not _offset_view_waits(funcol, impl):
        raise RuntimeError("AsyncCollectiveTensor views still do not wait after the patch")
    return True

"""profiler-use-cuda: the profilers' deprecated ``use_cuda`` argument, removed in torch 2.14, torch
2.14 and later.

What breaks:   training scripts from torch 1.8 to 2.13 profile a few steps with
               ``torch.profiler.profile(..., use_cuda=True)`` or
               ``torch.autograd.profiler.profile(use_cuda=True)``; on torch 2.14 and later the
               profiler's constructor dies with ``TypeError: __init__() got an unexpected keyword
               argument 'use_cuda'``, and the training run with it.
Torch:         2.14 and later. The argument was deprecated (a ``FutureWarning``) from 1.8.1 to 2.13.
Fix:           both constructors take ``use_cuda`` again, with torch 2.13's meaning and warning:
               - ``torch.profiler.profile``: the argument was inert there (it changed a local set of
                 activities that was only checked for being empty, never handed on): it warns, and
                 ``AssertionError: No valid profiler activities found`` is raised where 2.13 raised
                 it (``activities=[CUDA], use_cuda=False``); nothing else changes.
               - ``torch.autograd.profiler.profile``: ``use_cuda=True`` warns and means
                 ``use_device="cuda"`` (which torch itself turns off, with its own warning, where
                 CUDA is not available); ``use_cuda=False`` means ``use_device`` as given.
               The legacy profiler (``torch.autograd.profiler_legacy``) still has its own
               ``use_cuda`` and is left alone.
Upstream:      https://github.com/pytorch/pytorch/pull/192543 (the deprecated ``use_cuda`` removed
               from both profilers)
"""

import warnings
from types import ModuleType
from typing import Any, Callable, Dict, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="profiler-use-cuda",
    summary="torch.profiler.profile / torch.autograd.profiler.profile accept the removed use_cuda argument again",
    torch=">=2.14",
    upstream="https://github.com/pytorch/pytorch/pull/192543",
    behaviour="the profilers take use_cuda= (deprecated, removed in torch 2.14) with torch 2.13's meaning",
    errors=(
        Error(r"unexpected keyword argument 'use_cuda'",
              "TypeError: profile.__init__() got an unexpected keyword argument 'use_cuda'"),
    ),
)

_KINETO_WARNING = "`use_cuda` is deprecated, use `activities` argument instead"
_AUTOGRAD_WARNING = "The attribute `use_cuda` will be deprecated soon, please use ``use_device = 'cuda'`` instead."


def _takes_use_cuda(cls: type) -> bool:
    import inspect

    return "use_cuda" in inspect.signature(cls.__init__).parameters


def _kineto_init(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``torch.profiler.profile(..., use_cuda=...)`` as on torch 2.13: a warning and the emptiness check."""
    if "use_cuda" in kwargs:
        use_cuda = kwargs.pop("use_cuda")
        if use_cuda is not None:
            from torch.profiler import ProfilerActivity, supported_activities

            warnings.warn(_KINETO_WARNING, FutureWarning, stacklevel=3)
            activities = kwargs.get("activities")  # keyword-only, as every argument of this constructor
            chosen = set(supported_activities()) if activities is None else {
                key for item in activities for key in (item.keys() if isinstance(item, dict) else (item,))}
            if use_cuda:
                chosen.add(ProfilerActivity.CUDA)
            else:
                chosen.discard(ProfilerActivity.CUDA)
            if not chosen:
                raise AssertionError("No valid profiler activities found")
    return wrapped(*args, **kwargs)


def _autograd_init(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``torch.autograd.profiler.profile(use_cuda=True)`` as on torch 2.13: ``use_device="cuda"``."""
    if kwargs.pop("use_cuda", False) and kwargs.get("enabled", args[0] if args else True):
        warnings.warn(_AUTOGRAD_WARNING, FutureWarning, stacklevel=3)
        kwargs["use_device"] = "cuda"
    return wrapped(*args, **kwargs)


def _wrap_init(patcher: Patcher, cls: type, wrapper: Callable[..., Any]) -> bool:
    if _takes_use_cuda(cls):
        return False
    patcher.wrap(cls, "__init__", wrapper)
    return True


@PATCH.on_import("torch.profiler.profiler")
def kineto_profile(patcher: Patcher, module: ModuleType) -> bool:
    return _wrap_init(patcher, module.profile, _kineto_init)


@PATCH.on_import("torch.autograd.profiler")
def autograd_profile(patcher: Patcher, module: ModuleType) -> bool:
    return _wrap_init(patcher, module.profile, _autograd_init)

"""torch-compile-noop: ``torch.compile`` on torch 1.13, returning the model unchanged.

What breaks:   training scripts written for torch >= 2.0 call ``model = torch.compile(model)`` (or
               decorate a function with ``@torch.compile``) when a config flag asks for it; on torch
               1.13 that line dies with ``AttributeError: module 'torch' has no attribute 'compile'``.
Torch:         1.13 and older: TorchDynamo and Inductor came with torch 2.0 and cannot be
               backported. Nothing is served from 2.0 on.
Fix:           compilation is an optimisation: a compiled model computes what the eager one does.
               ``torch.compile(model, *, fullgraph, dynamic, backend, mode, options, disable)``
               (torch 2.0's arguments; as there, ``mode`` and ``options`` together are a
               ``RuntimeError``) returns ``model`` itself, so it runs eagerly with identical
               results and without the speed-up; called without a model it returns the decorator
               that does so. The first call warns, once per process, that nothing was compiled;
               with ``disable=True`` nothing is lost and nothing is said, as torch >= 2.0 returns the
               model unchanged there too. Unlike a real compiled module, the model is not wrapped:
               its ``state_dict`` keys have no ``_orig_mod.`` prefix. ``torch._dynamo`` and the
               rest of the compiler stack stay missing. The name is set as a plain attribute, not
               through a module ``__getattr__`` (torch 1.13 has none, and adding one slows every
               ``torch.X`` lookup on Python 3.11).
Upstream:      https://pytorch.org/get-started/pytorch-2.0/ (torch.compile, torch 2.0)
"""

import warnings
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="torch-compile-noop",
    summary="torch.compile on torch 1.13: returns the model unchanged (eager, same results), with one warning",
    torch="<2.0",
    upstream="https://pytorch.org/get-started/pytorch-2.0/",
    behaviour="torch.compile returns the model or function unchanged, where torch lacks it",
)
PATCH.sets("torch", ("compile",))

_warned = []  # one warning per process


def compile(  # noqa: A001 (torch's name)
    model: Optional[Callable[..., Any]] = None,
    *,
    fullgraph: bool = False,
    dynamic: Optional[bool] = None,
    backend: Union[str, Callable[..., Any]] = "inductor",
    mode: Optional[str] = None,
    options: Optional[Dict[str, Any]] = None,
    disable: bool = False,
) -> Any:
    """torch 2.0's ``torch.compile`` on a torch without a compiler: returns ``model`` itself, which
    then runs eagerly (same results, no speed-up); without ``model``, the decorator doing so."""
    if model is None:
        def decorator(fn: Callable[..., Any]) -> Any:
            return compile(fn, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode,
                           options=options, disable=disable)

        return decorator
    if mode is not None and options is not None:
        raise RuntimeError("Either mode or options can be specified, but both can't be specified at the same time.")
    if not disable and not _warned:
        import torch

        _warned.append(True)
        warnings.warn(
            f"torch.compile needs torch >= 2.0 (TorchDynamo); on torch {torch.__version__} torchpatch returns "
            "the model unchanged: it runs eagerly, with the same results and without the speed-up.",
            UserWarning,
            stacklevel=2,
        )
    return model


@PATCH.on_import("torch")
def set_compile(patcher: Patcher, torch: ModuleType) -> bool:
    if "compile" in vars(torch):
        return False
    patcher.setattr(torch, "compile", compile)
    return True

"""pipelining-backward-requires-autograd: the looped pipeline schedules take
``backward_requires_autograd=``, torch 2.4-2.9.

What breaks:   torchtitan 0.3.0 builds every looped schedule (Interleaved1F1B, LoopedBFS, the
               zero-bubble ones, DualPipeV) with ``backward_requires_autograd=True`` (its Graph PP
               passes False), so its PP jobs die before the first step: ``TypeError:
               ScheduleInterleaved1F1B.__init__() got an unexpected keyword argument
               'backward_requires_autograd'``.
Torch:         2.4-2.9 (2.10 added it with the schedule runtime's custom functions; 2.13-2.15 have it).
               In 2.15 it only decides whether ``step()`` refuses to run under ``torch.no_grad()``
               (``RuntimeError: step() requires gradients ...``) when the schedule has a backward:
               True (the default) refuses, False lets a step whose backward actions run custom
               functions (``register_custom_function``: Graph PP) go on without autograd.
Fix:           every ``PipelineScheduleMulti`` of torch's ``schedules`` module (and the ones torchpatch
               serves on older torches) takes the keyword (default True; in its signature too) and keeps it
               as ``schedule._backward_requires_autograd``. True is this torch's own behaviour (2.9's
               looped ``step`` refuses ``torch.no_grad()`` as 2.15 does; 2.4's has no such check: such
               a step runs on, and on gloo its ranks hung, measured). False raises ``NotImplementedError``: these torches have
               no custom functions for a backward action, so every backward is autograd's and a schedule
               that does not need it cannot be built.
Upstream:      https://github.com/pytorch/pytorch/pull/167277 (``backward_requires_autograd``, torch 2.10)
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="pipelining-backward-requires-autograd",
    summary="looped pipeline schedules accept backward_requires_autograd= (True: this torch's autograd "
    "backward; False, custom backward functions, refused)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/pull/167277",
    behaviour="PipelineScheduleMulti(..., backward_requires_autograd=True)",
    errors=(
        Error(r"unexpected keyword argument 'backward_requires_autograd'",
              "TypeError: ScheduleInterleaved1F1B.__init__() got an unexpected keyword argument "
              "'backward_requires_autograd'"),
    ),
)

SCHEDULES = "torch.distributed.pipelining.schedules"
_KEYWORD = "backward_requires_autograd"


def _accepting(init: Callable[..., None]) -> Callable[..., None]:
    """``init`` (a looped schedule's ``__init__``) taking ``backward_requires_autograd`` (keyword,
    default True), in its signature too."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, backward_requires_autograd: bool = True, **kwargs: Any) -> None:
        if not backward_requires_autograd:
            import torch

            raise NotImplementedError(
                f"{type(self).__name__}(backward_requires_autograd=False) on torch {torch.__version__}: this "
                "torch's pipeline schedules run every backward with autograd (custom functions for backward "
                "actions, register_custom_function, came with torch 2.10), so a schedule stepping without "
                "autograd (Graph PP) cannot be built; torchpatch does not serve it")
        init(self, *args, **kwargs)
        self._backward_requires_autograd = True

    params = list(inspect.signature(init).parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter(_KEYWORD, inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool))
    __init__.__signature__ = inspect.signature(init).replace(parameters=params)  # type: ignore[attr-defined]
    return __init__


def _take_keyword(patcher: Patcher, cls: type) -> None:
    """Make ``cls``'s own ``__init__``, if it has one without the keyword, take it."""
    init = vars(cls).get("__init__")
    if init is not None and _KEYWORD not in inspect.signature(init).parameters:
        patcher.setattr(cls, "__init__", _accepting(init))


@PATCH.on_import(SCHEDULES)
def schedules_take_keyword(patcher: Patcher, schedules: Any) -> bool:
    base = schedules.PipelineScheduleMulti
    if _KEYWORD in inspect.signature(base.__init__).parameters:
        return False
    for cls in vars(schedules).values():
        if isinstance(cls, type) and issubclass(cls, base):
            _take_keyword(patcher, cls)
    own = vars(base).get("__init_subclass__")  # a classmethod, where torch defines one

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        """The schedules torchpatch serves later (pipelining-zbv's, -interleaved-zb's, -dualpipev's) take it too;
        a user's subclass is left as written."""
        if own is not None:
            own.__get__(None, cls)(**kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        if cls.__module__ == SCHEDULES or cls.__module__.startswith("torchpatch."):
            _take_keyword(patcher, cls)

    patcher.setattr(base, "__init_subclass__", classmethod(__init_subclass__))
    return True

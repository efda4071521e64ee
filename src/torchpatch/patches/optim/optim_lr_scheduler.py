"""optim-lr-scheduler: ``torch.optim.lr_scheduler.LRScheduler``, the public name of the scheduler
base class, on torch 1.13.

What breaks:   torchtitan (early 2025) and other code written for torch >= 2.0 does
               ``from torch.optim.lr_scheduler import LRScheduler`` (to annotate, to subclass, to
               check ``isinstance``) and on torch 1.13 dies at import with ``ImportError: cannot
               import name 'LRScheduler' from 'torch.optim.lr_scheduler'``.
Torch:         1.13 and older call the base class ``_LRScheduler``; torch 2.0 renamed it
               ``LRScheduler`` and kept ``_LRScheduler`` as a subclass of it. Nothing is served from
               2.0 on.
Fix:           serve ``LRScheduler`` as 1.13's ``_LRScheduler`` itself: every scheduler of the
               installed torch (``LambdaLR``, ``StepLR``, ...) is an instance of it, and a subclass
               gets the base class's ``step``/``get_last_lr``/``state_dict`` of this torch. As on
               torch < 2.2, ``ReduceLROnPlateau`` is not one of its subclasses.
Upstream:      https://github.com/pytorch/pytorch/pull/88503 (``_LRScheduler`` made public as
               ``LRScheduler``, torch 2.0)
"""

from torchpatch import Patch

PATCH = Patch(
    id="optim-lr-scheduler",
    summary="torch.optim.lr_scheduler.LRScheduler (the scheduler base class, _LRScheduler)",
    torch="<2.0",
    upstream="https://github.com/pytorch/pytorch/pull/88503",
)


@PATCH.symbol("torch.optim.lr_scheduler", "LRScheduler")
def serve_lr_scheduler() -> type:
    from torch.optim.lr_scheduler import _LRScheduler

    return _LRScheduler

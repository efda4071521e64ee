"""lr-scheduler-state-verbose: LR schedulers' ``state_dict()`` without ``verbose``, as torch 2.7 and
later give it, on torch 1.13-2.6.

What breaks:   a training job resumed on an older torch from a DCP checkpoint a newer torch saved
               (torchtitan 0.1.0 on torch 2.4.1 resuming torch 2.15.0's checkpoint) dies in
               ``dcp.load`` with ``Missing key in checkpoint state_dict: lr_scheduler.verbose``: DCP
               loads exactly the keys of the local state dict, and the older scheduler's has a
               ``verbose`` entry that torch 2.7+ no longer writes.
Torch:         1.13-2.6: every scheduler's ``__init__`` stores ``self.verbose`` and the
               ``state_dict()`` methods (``LRScheduler``'s, which the others inherit, and the own ones
               of ``LambdaLR``, ``MultiplicativeLR``, ``SequentialLR``, ``ChainedScheduler`` (their
               nested states too), ``ReduceLROnPlateau``, ``CyclicLR``) return every ``__dict__``
               entry but the optimizer (and the callables), ``verbose`` included. torch 2.7 removed
               the argument and the attribute.
Fix:           wrap the ``state_dict`` each scheduler class of ``torch.optim.lr_scheduler`` defines
               itself so that the dict it returns has no ``verbose`` key (``SWALR`` and user subclasses
               inherit it). The scheduler keeps this torch's behaviour: its ``verbose`` attribute and
               printing stay, and ``load_state_dict`` still takes an older state dict with ``verbose``
               (it then sets the attribute, as before) or a newer one without (the attribute stays as
               constructed). Other keys still differ from torch 2.15's (2.15 adds ``_is_initial``,
               ``ReduceLROnPlateau`` ``default_min_lr`` (and ``_last_lr`` on 1.13-2.1), ``SWALR``
               ``_anneal_strategy`` for ``anneal_func``, ...): a newer checkpoint's extra keys are
               ignored by DCP, so it loads; they are not served.
Upstream:      https://github.com/pytorch/pytorch/pull/147301 (``verbose`` removed, torch 2.7)
"""

from inspect import signature
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="lr-scheduler-state-verbose",
    summary="LR schedulers' state_dict() without the verbose entry torch 2.7 removed (DCP resume of newer checkpoints)",
    torch="<2.7",
    upstream="https://github.com/pytorch/pytorch/pull/147301",
    behaviour="LR schedulers' state_dict() has no verbose key",
)


def _without_verbose(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    state = wrapped(*args, **kwargs)
    if isinstance(state, dict):
        state.pop("verbose", None)
    return state


@PATCH.on_import("torch.optim.lr_scheduler")
def drop_verbose(patcher: Patcher, module: ModuleType) -> bool:
    base = getattr(module, "LRScheduler", None) or module._LRScheduler
    if "verbose" not in signature(base.__init__).parameters:
        return False
    for cls in list(vars(module).values()):
        if isinstance(cls, type) and cls.__module__ == module.__name__ and "state_dict" in vars(cls):
            patcher.wrap(cls, "state_dict", _without_verbose)
    return True

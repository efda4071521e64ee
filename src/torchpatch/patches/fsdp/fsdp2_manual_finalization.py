"""fsdp2-manual-finalization: FSDP2's manual backward finalization and ``GradientReductionHandle``,
torch 2.4-2.14.

What breaks:   code written for torch 2.15 that finalizes FSDP2's backward itself (pipeline schedules
               that run gradient reduction as a separate action, gradient accumulation over several
               backward calls) dies with ``AttributeError: 'FSDPLinear' object has no attribute
               'set_manual_backward_finalization'`` (then ``... 'finalize_backward'``), and
               ``from torch.distributed.fsdp import GradientReductionHandle`` with ``ImportError``.
Torch:         2.15 added ``FSDPModule.set_manual_backward_finalization(enabled)``,
               ``FSDPModule.finalize_backward(*, async_op=False)`` and ``GradientReductionHandle``;
               2.4-2.14's FSDP2 finalizes backward only in its root post-backward autograd callback, when
               ``is_last_backward`` is set (read in 2.4.1's ``_composable/fsdp``, 2.9.0's, 2.13.0's and
               2.14.1's ``fsdp/_fully_shard``: the same callback, ``is_last_backward`` and re-runnable
               ``FSDPParamGroup.post_backward``).
Fix:           a behaviour patch on FSDP2's Python runtime with 2.15's semantics and errors (see
               ``_manual_finalization``): in manual mode the root post-backward callback runs as for a
               backward that is not the last, deferring the post-backward (reduce-scatter, reshard) of the
               groups autograd did not reach; ``finalize_backward`` runs the deferred post-backwards and
               those of groups still holding unreduced gradients, then (at once, or at
               ``GradientReductionHandle.wait()`` with ``async_op=True``) the callback's own last-backward
               tail. A forward before the wait, a mode change during or after backward, a call on a
               non-root module, a wait on a handle that ``reset_iter_state`` invalidated raise 2.15's
               ``RuntimeError``s. Until a root first turns manual mode on (or sets ``is_last_backward``
               to False: an automatic backward that is not the last forbids a later mode change, as on
               2.15), FSDP2's callback, forward and ``reset_iter_state`` are torch's own, unwrapped: a
               step in automatic mode makes no call into torchpatch. The wraps, made then through the
               hook's patcher, are undone with the patch.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/fsdp/_fully_shard/_fully_shard.py
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Dict

from torchpatch import Patch, Patcher

from ._manual_finalization import (
    COMM_CTX_DEFAULTS, GROUP_DEFAULTS, STATE_CTX_DEFAULTS, GradientReductionHandle, Runtime
)

PATCH = Patch(
    id="fsdp2-manual-finalization",
    summary="FSDPModule.set_manual_backward_finalization / finalize_backward(async_op=) and "
    "torch.distributed.fsdp.GradientReductionHandle (FSDP2's manual backward finalization)",
    torch=">=2.4,<2.15",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/fsdp/_fully_shard/_fully_shard.py",
    behaviour="FSDPModule.set_manual_backward_finalization, FSDPModule.finalize_backward",
)

# FSDP2's homes: torch 2.4-2.5, then torch >= 2.6
HOMES = ("torch.distributed._composable.fsdp", "torch.distributed.fsdp._fully_shard")
METHODS = ("set_manual_backward_finalization", "finalize_backward")
_RUNTIMES: Dict[type, Runtime] = {}


def _runtime(home: str) -> Runtime:
    """The manual finalization of the FSDP2 at ``home`` (made once, from torch's unwrapped callback)."""
    state_type = importlib.import_module(home + "._fsdp_state").FSDPState
    if state_type not in _RUNTIMES:
        common = importlib.import_module(home + "._fsdp_common")
        callback = vars(state_type)["_root_post_backward_final_callback"]
        unsharded_param = importlib.import_module(home + "._fsdp_param").FSDPParam.unsharded_param.fget
        _RUNTIMES[state_type] = Runtime(state_type, common.TrainingState, common.DDPMeshInfo,
                                        getattr(callback, "__wrapped__", callback),
                                        "_assert_in_states" in unsharded_param.__code__.co_names)
    return _RUNTIMES[state_type]


def _patch_state(patcher: Patcher, state_module: ModuleType) -> bool:
    state_type = state_module.FSDPState
    if hasattr(state_type, "finalize_backward"):
        return False  # torch >= 2.15
    home = state_module.__name__.rsplit(".", 1)[0]
    runtime = _runtime(home)
    group_module = importlib.import_module(home + "._fsdp_param_group")
    for owner, defaults in ((state_module.FSDPStateContext, STATE_CTX_DEFAULTS),
                            (group_module.FSDPCommContext, COMM_CTX_DEFAULTS),
                            (group_module.FSDPParamGroup, GROUP_DEFAULTS)):
        for name, value in defaults.items():
            patcher.setattr(owner, name, value)

    def wrap_hot_path() -> None:
        """FSDP2's per-step methods wrapped, once, when a root first needs them (through this
        hook's patcher, which the engine keeps for changes made later: undone with the patch)."""
        runtime.wrap_hot_path = None
        patcher.wrap(state_type, "_root_post_backward_final_callback", runtime.root_post_backward_callback)
        patcher.wrap(state_type, "_root_pre_forward", runtime.root_pre_forward)
        if "_reset_iter_state" in vars(state_type):  # torch >= 2.13
            patcher.wrap(state_type, "_reset_iter_state", runtime.reset_iter_state)

    runtime.wrap_hot_path = wrap_hot_path
    patcher.on_undo(lambda: setattr(runtime, "wrap_hot_path", None))
    return True


def _runtime_home() -> str:
    """The one of HOMES that holds this torch's FSDP2 runtime: its ``_fsdp_state`` is imported by the time
    any ``fully_shard`` module is (importing to look could re-enter a package being initialised)."""
    return next(home for home in HOMES if home + "._fsdp_state" in sys.modules)


def _patch_module(patcher: Patcher, fully_shard_module: ModuleType) -> bool:
    fsdp_module: Any = fully_shard_module.FSDPModule
    if hasattr(fsdp_module, "finalize_backward"):
        return False  # torch >= 2.15
    home = _runtime_home()  # on torch >= 2.6 _composable.fsdp.fully_shard re-exports fsdp._fully_shard's
    runtime = _runtime(home)
    for name, method in runtime.module_methods().items():
        method.__qualname__ = f"FSDPModule.{name}"
        patcher.setattr(fsdp_module, name, method)

    def set_is_last_backward(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        """A backward that is not the last: the callback's wrap records automatic mode from then on."""
        if runtime.wrap_hot_path is not None and not (args[0] if args else kwargs["is_last_backward"]):
            runtime.wrap_hot_path()
        return wrapped(*args, **kwargs)

    patcher.wrap(fsdp_module, "set_is_last_backward", set_is_last_backward)
    return True


for _home, _fully_shard in zip(HOMES, ("fully_shard", "_fully_shard")):
    PATCH.on_import(f"{_home}._fsdp_state")(_patch_state)
    PATCH.on_import(f"{_home}.{_fully_shard}")(_patch_module)

for _module in ("torch.distributed.fsdp", "torch.distributed.fsdp._fully_shard",
                "torch.distributed.fsdp._fully_shard._fully_shard"):
    PATCH.symbol(_module, "GradientReductionHandle")(lambda: GradientReductionHandle)
PATCH.sets("torch.distributed.fsdp.FSDPModule", METHODS, torch=">=2.6")
PATCH.sets("torch.distributed._composable.fsdp.FSDPModule", METHODS, torch="<2.6")

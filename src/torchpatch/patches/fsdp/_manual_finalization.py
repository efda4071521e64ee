"""FSDP2's manual backward finalization on an older FSDP2 runtime (torch 2.15's semantics and errors).

The older runtime finalizes backward in its root post-backward callback when ``is_last_backward`` is
set: each group's ``finalize_backward``, the post-forward order cleared, the reduce-scatters waited on.
In manual mode that callback runs as for a backward that is not the last, with the post-backward of
the groups autograd did not reach deferred; ``finalize_backward`` then runs the deferred post-backwards
(and those of groups still holding unreduced gradients) and, now or at ``GradientReductionHandle.wait``,
the callback's last-backward tail, with every post-backward already done.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

_MODE_ERRORS = {
    "root": "set_manual_backward_finalization must be called on the root {name} module",
    "during": "set_manual_backward_finalization cannot change mode during backward",
    "after": "set_manual_backward_finalization cannot change mode after backward starts",
}
# Attributes torch 2.15 keeps on FSDPStateContext, FSDPCommContext and FSDPParamGroup: class defaults here.
STATE_CTX_DEFAULTS = {"manual_backward_finalization": False, "manual_backward_finalization_active": None,
                      "gradient_reduction_pending": False}
COMM_CTX_DEFAULTS = {"active_gradient_reduction": None}
GROUP_DEFAULTS = {"_post_backward_pending": False}


class GradientReductionHandle:
    """A handle for asynchronous backward finalization."""

    def wait(self) -> None:
        """Wait for gradient reduction and release its retained buffers.

        Raises:
            RuntimeError: If :meth:`FSDPModule.reset_iter_state` invalidated this handle.
        """
        return


GradientReductionHandle.__module__ = "torch.distributed.fsdp"


class _GradientReduction:
    """The one gradient reduction in flight on a communication context, owned by a root's state context."""

    def __init__(self, owner: object) -> None:
        self.owner = owner


class _GradientReductionHandleImpl(GradientReductionHandle):
    def __init__(self, runtime: Optional["Runtime"], state: Any, reduction: Optional[_GradientReduction]) -> None:
        self._runtime, self._state, self._reduction = runtime, state, reduction

    def wait(self) -> None:
        if self._runtime is not None and self._reduction is not None:
            self._runtime.wait_for_gradient_reduction(self._state, self._reduction)
            self._runtime = self._state = self._reduction = None


def _groups(state: Any) -> List[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.13: at most one group per state
        group = state._fsdp_param_group
        groups = [group] if group is not None else []
    return list(groups)


def _name(state: Any) -> str:
    return getattr(state, "_state_name", "FSDP")


def _holds_unreduced_grads(group: Any) -> bool:
    """Whether a post-backward left gradients unreduced (gradient sync was off), as torch 2.15 marks
    such a group post-backward pending."""
    for fsdp_param in group.fsdp_params:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if fsdp_param.unsharded_accumulated_grad is not None or (unsharded is not None and unsharded.grad is not None):
            return True
    return False


@contextlib.contextmanager
def _without_post_backward(groups: List[Any]) -> Iterator[None]:
    """The callback skips these groups' post-backward (deferred, or already run)."""
    for group in groups:
        group.post_backward = lambda *unused: None
    try:
        yield
    finally:
        for group in groups:
            del group.post_backward


@contextlib.contextmanager
def _is_last_backward(state_ctx: Any, value: bool) -> Iterator[None]:
    user_value = state_ctx.is_last_backward
    state_ctx.is_last_backward = value
    try:
        yield
    finally:
        state_ctx.is_last_backward = user_value


class Runtime:
    """The manual finalization of one torch's FSDP2: its ``FSDPState``, ``TrainingState``, ``DDPMeshInfo``,
    the unwrapped root post-backward callback, and whether its post-backward reads a gradient only off
    an unsharded parameter (torch 2.4's ``FSDPParam.unsharded_param`` asserts the state)."""

    def __init__(self, state_type: type, training_state: Any, ddp_mesh_info: type,
                 callback: Callable[[Any], None], reduce_needs_unshard: bool) -> None:
        self.state_type, self.training_state, self.ddp_mesh_info = state_type, training_state, ddp_mesh_info
        self.callback, self.reduce_needs_unshard = callback, reduce_needs_unshard
        # Wraps FSDPState's per-step methods with the hooks below, once; None once done (or the patch undone).
        self.wrap_hot_path: Optional[Callable[[], None]] = None

    def all_groups(self, state: Any) -> List[Any]:
        return [group for each in state._state_ctx.all_states for group in _groups(each)]

    # -- hooks on FSDPState ------------------------------------------------------------------------
    def root_post_backward_callback(self, wrapped: Any, instance: Any, args: Tuple[Any, ...],
                                    kwargs: Dict[str, Any]) -> Any:
        state_ctx = instance._state_ctx
        if state_ctx.manual_backward_finalization_active is None:
            state_ctx.manual_backward_finalization_active = state_ctx.manual_backward_finalization
        if not state_ctx.manual_backward_finalization_active:
            result = wrapped(*args, **kwargs)
            if state_ctx.is_last_backward:
                state_ctx.manual_backward_finalization_active = None
            return result
        deferred = [group for group in self.all_groups(instance)
                    if group._training_state != self.training_state.POST_BACKWARD and group.reduce_grads]
        for group in deferred:
            group._post_backward_pending = True
        with _without_post_backward(deferred), _is_last_backward(state_ctx, False):
            return wrapped(*args, **kwargs)

    def root_pre_forward(self, wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if instance._state_ctx.gradient_reduction_pending or instance._comm_ctx.active_gradient_reduction is not None:
            raise RuntimeError("The previous gradient reduction must be waited on before forward")
        modules = getattr(instance, "_modules", None) or (instance._module,)  # torch 2.4-2.5: one module
        if instance._is_root is None and len(modules) == 1:  # this state's lazy init makes it the root
            from torch.distributed._composable_state import _get_module_state

            for module in modules[0].modules():
                state = _get_module_state(module)
                if (isinstance(state, self.state_type) and state is not instance
                        and state._state_ctx.manual_backward_finalization):
                    raise RuntimeError(_MODE_ERRORS["root"].format(name=_name(instance)))
        return wrapped(*args, **kwargs)

    def reset_iter_state(self, wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        reduction = instance._comm_ctx.active_gradient_reduction
        if instance._is_root is not False and reduction is not None and reduction.owner is not instance._state_ctx:
            raise RuntimeError("reset_iter_state cannot reset a gradient reduction owned by another FSDP root "
                               "sharing the communication context")
        result = wrapped(*args, **kwargs)
        for group in self.all_groups(instance):
            group._post_backward_pending = False
        instance._state_ctx.manual_backward_finalization_active = None
        instance._state_ctx.gradient_reduction_pending = False
        instance._comm_ctx.active_gradient_reduction = None
        return result

    # -- torch 2.15's FSDPState.finalize_backward and wait_for_gradient_reduction ------------------
    def validate(self, state: Any) -> None:
        state_ctx = state._state_ctx
        if state._is_root is None:
            raise RuntimeError("finalize_backward must be called after the first forward")
        if state_ctx.gradient_reduction_pending:
            raise RuntimeError("The previous gradient reduction must be waited on before finalizing backward again")
        if not state._is_root:
            raise RuntimeError(f"finalize_backward must be called on the root {_name(state)} module")
        manual = state_ctx.manual_backward_finalization_active
        if not (state_ctx.manual_backward_finalization if manual is None else manual):
            raise RuntimeError(f"{_name(state)} finalize_backward requires manual backward finalization. "
                               "Call set_manual_backward_finalization(True) before forward")
        if state_ctx.post_backward_final_callback_queued:
            raise RuntimeError(f"{_name(state)} finalize_backward must be called after backward completes")
        groups = self.all_groups(state)
        for group in groups:
            if group._partial_reduce_output is not None:
                raise RuntimeError(
                    f"{_name(state)} manual backward finalization does not support partial gradient reductions "
                    f"for parameter group {group._module_fqn or '<root>'!r}. Use automatic backward "
                    "finalization for this configuration")
        for group in groups:
            if (self._pending(group) and group.reduce_grads and isinstance(group.mesh_info, self.ddp_mesh_info)
                    and not group.all_reduce_grads):
                raise RuntimeError(
                    f"{_name(state)} manual backward finalization requires all-reduce for parameter group "
                    f"{group._module_fqn or '<root>'!r}. Call set_requires_all_reduce(True) before finalization")

    @staticmethod
    def _pending(group: Any) -> bool:
        return group._post_backward_pending or _holds_unreduced_grads(group)

    def finalize_backward(self, state: Any, wait_for_gradient_reduction: bool = True) -> None:
        if state._is_root is None:
            return
        self.validate(state)
        for each in reversed(state._state_ctx.all_states):
            for group in reversed(_groups(each)):
                if self._pending(group):
                    group._post_backward_pending = False
                    if self.reduce_needs_unshard and not group.is_unsharded:  # resharded after a no-sync backward
                        group.unshard()
                        group.wait_for_unshard()
                    group.post_backward()
                elif group.reshard_after_backward:
                    group.reshard()
                group._training_state = self.training_state.IDLE
        if wait_for_gradient_reduction:
            self.wait_for_gradient_reduction(state)

    def wait_for_gradient_reduction(self, state: Any, reduction: Optional[_GradientReduction] = None) -> None:
        """Wait for gradient reduction and finish the backward iteration: the older callback's
        last-backward tail, every post-backward being done."""
        if reduction is not None and state._comm_ctx.active_gradient_reduction is not reduction:
            raise RuntimeError("This gradient reduction handle was invalidated")
        with _without_post_backward(self.all_groups(state)), _is_last_backward(state._state_ctx, True):
            self.callback(state)
        state._state_ctx.manual_backward_finalization_active = None
        if reduction is not None:
            state._state_ctx.gradient_reduction_pending = False
            state._comm_ctx.active_gradient_reduction = None

    # -- torch 2.15's FSDPModule methods -----------------------------------------------------------
    def module_methods(self) -> Dict[str, Callable[..., Any]]:
        runtime = self

        def set_manual_backward_finalization(self: Any, enabled: bool) -> None:
            """Set whether the caller must finalize backward (with :meth:`finalize_backward`, after all
            backward passes of the logical backward and before reading or clearing gradients). Call
            it on the root FSDP module, before backward."""
            import torch

            state = self._get_fsdp_state()
            state_ctx = state._state_ctx
            if state._is_root is False:
                raise RuntimeError(_MODE_ERRORS["root"].format(name=_name(state)))
            if enabled != state_ctx.manual_backward_finalization and torch._C._current_graph_task_id() != -1:
                raise RuntimeError(_MODE_ERRORS["during"])
            active = state_ctx.manual_backward_finalization_active
            if active is not None and enabled != active:
                raise RuntimeError(_MODE_ERRORS["after"])
            if enabled and runtime.wrap_hot_path is not None:
                runtime.wrap_hot_path()
            state_ctx.manual_backward_finalization = enabled

        def finalize_backward(self: Any, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
            """Finalize backward on the calling thread: complete pending gradient reduction and
            resharding. With ``async_op=True``, return a :class:`GradientReductionHandle` to
            ``wait()`` on before using the gradients."""
            state = self._get_fsdp_state()
            if state._is_root is None:
                return _GradientReductionHandleImpl(None, None, None) if async_op else None
            if state._state_ctx.gradient_reduction_pending:
                raise RuntimeError(
                    "The previous gradient reduction must be waited on before finalizing backward again")
            if state._comm_ctx.active_gradient_reduction is not None:
                raise RuntimeError("Another gradient reduction sharing this communication context must be waited "
                                   "on before finalizing backward")
            if not async_op:
                runtime.finalize_backward(state)
                return None
            runtime.validate(state)
            own_groups = set(runtime.all_groups(state))
            others = [getattr(rs, "param_group", None) for rs in getattr(state._comm_ctx, "reduce_scatter_states", ())]
            others += list(state._comm_ctx.post_forward_order)
            if any(group is not None and group not in own_groups for group in others):
                raise RuntimeError("Asynchronous gradient finalization cannot overlap work from another FSDP root "
                                   "sharing the communication context")
            reduction = _GradientReduction(state._state_ctx)
            state._comm_ctx.active_gradient_reduction = reduction
            runtime.finalize_backward(state, wait_for_gradient_reduction=False)
            state._state_ctx.gradient_reduction_pending = True
            return _GradientReductionHandleImpl(runtime, state, reduction)

        return {"set_manual_backward_finalization": set_manual_backward_finalization,
                "finalize_backward": finalize_backward}


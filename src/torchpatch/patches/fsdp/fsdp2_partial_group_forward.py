"""fsdp2-partial-group-forward: a grouped ``fully_shard([norm, lm_head])`` whose modules run in
separate calls (chunked loss) frees the norm's weight before its backward, torch 2.5-2.12.

What breaks:   torchtitan 0.3's chunked cross-entropy (``ChunkedCELoss``) wraps
               ``fully_shard([model.norm, model.lm_head])``: the model's forward runs ``norm`` only,
               then the loss calls ``lm_head`` on each chunk of the hidden states with a backward per
               chunk, and the final backward runs through ``norm`` and the decoder. FSDP2 before
               torch 2.13 runs a group's pre-forward only when its first module starts and its
               post-forward (reshard, pre-backward hook) only when every module ran in one pass: the
               norm's output gets no pre-backward hook, the first chunk's post-forward hands its
               hook to the chunk's logits, whose backward then finishes the whole iteration (the
               root's final callback), and the later chunks register nothing. The final backward
               reaches ``norm`` with its parameters freed: a segmentation fault in ``MulBackward0``
               (torch 2.9.0, CPU) or garbage gradients.
Torch:         2.5 (grouped ``fully_shard``) to 2.12 (read in 2.9.0's ``fsdp/_fully_shard``:
               ``_register_group_forward_hooks`` gates both hooks on the set of modules still to
               run); torch 2.13 supports the partial pass (reproduced: 2.9.0 crashes, 2.13.0 and
               2.15.0 train torchtitan 0.3.0's debug model).
Fix:           as upstream: the group's pre-forward hook runs for every module (the state's root
               pre-forward and forward prefetch once per pass, the parameter group's post-backward
               hook once per pass), its post-forward only when the module completes the pass (the
               others apply the ``output_dtype`` cast only); the root's post-forward completes each
               group the pass left incomplete (reshard, pre-backward hook on the root's output);
               the root's post-backward callback clears the forward root and the modules still to
               run. Applied where ``FSDPState`` lacks ``_force_complete_incomplete_states``.
Upstream:      https://github.com/pytorch/pytorch/pull/180428 (torch 2.13)
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Set, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="fsdp2-partial-group-forward",
    summary="FSDP2: a grouped fully_shard([a, b]) whose modules run in separate calls (chunked loss) "
            "keeps its hooks (torch < 2.13 freed the parameters before their backward)",
    torch=">=2.5,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/180428",
    behaviour="fully_shard([module_a, module_b]) with the modules run in separate forward calls",
    category="correctness",
)

_FORWARD = "FORWARD"
_PRE_BACKWARD = "PRE_BACKWARD"


def _groups(state: Any) -> List[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.11: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _states(root: Any) -> Iterator[Any]:
    """The root's states, once each (torch 2.9 lists a grouped state once per module)."""
    return iter({id(state): state for state in root._state_ctx.all_states}.values())


def _in(state_or_group: Any, name: str) -> bool:
    return state_or_group._training_state.name == name


def _cast(state: Any, dtype: Any, tree: Any) -> Any:
    """``tree``'s floating-point tensors cast to ``dtype`` (none: as is), as FSDP2 casts them."""
    if dtype is None:
        return tree
    import sys

    from torch.distributed.utils import _apply_to_tensors

    cast_fp_tensor = sys.modules[type(state).__module__]._cast_fp_tensor
    return _apply_to_tensors(functools.partial(cast_fp_tensor, dtype), tree)


def _group_forward_hooks(state_module: ModuleType, wrap_states: Callable[[], None]) -> Callable[..., Any]:
    """torch 2.13's ``_register_group_forward_hooks``: the pre-hook on every module, the post-hook
    when the module completes the pass (the others only cast the output). FSDP2 calls it only for a
    grouped ``fully_shard`` (several modules); the first call runs ``wrap_states``."""
    disable = getattr(state_module, "disable_if_config_true", None) or (lambda fn: fn)

    def register(modules: Any, pre_hook: Callable[..., Any], post_hook: Callable[..., Any],
                 modules_to_run: Set[Any], *_more: Any) -> Any:
        wrap_states()
        everyone = set(modules)
        state = pre_hook.__self__  # its hooks as now wrapped (FSDP2 bound them before this call)
        pre_hook, post_hook = getattr(state, pre_hook.__name__), getattr(state, post_hook.__name__)

        @disable
        @functools.wraps(pre_hook)
        def wrapped_pre_hook(*args: Any, **kwargs: Any) -> Any:
            if not modules_to_run:
                modules_to_run.update(everyone)
            return pre_hook(*args, **kwargs)

        def post_hook_of(module: Any) -> Callable[..., Any]:
            @disable
            @functools.wraps(post_hook)
            def wrapped_post_hook(hook_module: Any, inputs: Any, output: Any) -> Any:
                if module in modules_to_run:
                    modules_to_run.remove(module)
                    if not modules_to_run:
                        return post_hook(hook_module, inputs, output)
                return _cast(state, state._mp_policy.output_dtype, output)

            return wrapped_post_hook

        handles = [m.register_forward_pre_hook(wrapped_pre_hook, prepend=True, with_kwargs=True) for m in modules]
        handles += [m.register_forward_hook(post_hook_of(m), prepend=False, always_call=True) for m in modules]
        return state_module._MultiHandle(tuple(handles))

    original = state_module._register_group_forward_hooks  # its names: code (and relocations) look it up by them
    register.__name__, register.__qualname__, register.__module__ = original.__name__, original.__qualname__, original.__module__
    return register


def _pre_forward(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """A later module of the pass: cast its inputs and unshard; root pre-forward and prefetch ran."""
    if not _in(instance, _FORWARD):
        return wrapped(*args, **kwargs)
    module, fwd_args, fwd_kwargs = args
    policy = instance._mp_policy
    if policy.cast_forward_inputs:
        fwd_args, fwd_kwargs = _cast(instance, policy.param_dtype, (fwd_args, fwd_kwargs))
    for group in _groups(instance):
        fwd_args, fwd_kwargs = group.pre_forward(module, fwd_args, fwd_kwargs)
    return fwd_args, fwd_kwargs


def _group_pre_forward(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Register the post-backward hook once per pass (a later module of the pass only unshards)."""
    if not _in(instance, _FORWARD):
        return wrapped(*args, **kwargs)
    instance.unshard(instance.unshard_async_op)
    instance.wait_for_unshard()
    return args[1], args[2]


def _post_forward(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The forward root completes the groups its pass left incomplete."""
    module, inputs, output = args
    if instance._state_ctx.iter_forward_root is instance and not _in(instance, _PRE_BACKWARD):
        for state in reversed(list(_states(instance))):
            if state is instance or not state._modules_to_run_forward:
                continue
            for group in _groups(state):
                output = group.post_forward(None, None, output)
            output = state._register_pre_backward_hook(output)
            state._training_state = type(state._training_state).IDLE
            output = _cast(state, state._mp_policy.output_dtype, output)
            state._modules_to_run_forward.clear()
    return wrapped(module, inputs, output)


def _final_callback(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """Each iteration starts afresh: a standalone call of a group's module claimed the forward root
    and left modules to run."""
    instance._state_ctx.iter_forward_root = None
    for state in _states(instance):
        state._modules_to_run_forward.clear()
    return wrapped(*args, **kwargs)


def _patch_fsdp2(patcher: Patcher, state_module: ModuleType) -> bool:
    state_class = state_module.FSDPState
    if hasattr(state_class, "_force_complete_incomplete_states"):
        return False  # torch >= 2.13 supports the partial pass
    wrapped: List[bool] = []

    def wrap_states() -> None:
        """FSDPState's and FSDPParamGroup's per-step methods wrapped, once, when the first grouped
        ``fully_shard`` is made (through this hook's patcher, which the engine keeps for changes made
        later: undone with the patch): a model of single-module ``fully_shard`` calls never calls in.
        The states the wraps matter for are made after it: the group's own, and its ancestors (a
        forward root that completes it), as ``fully_shard`` goes bottom-up."""
        if wrapped:
            return
        wrapped.append(True)
        patcher.wrap(state_class, "_pre_forward", _pre_forward)
        patcher.wrap(state_class, "_post_forward", _post_forward)
        patcher.wrap(state_class, "_root_post_backward_final_callback", _final_callback)
        patcher.wrap(state_module.FSDPParamGroup, "pre_forward", _group_pre_forward)

    patcher.setattr(state_module, "_register_group_forward_hooks", _group_forward_hooks(state_module, wrap_states))
    return True


# FSDP2's home: torch 2.5, then torch >= 2.6
for _module in ("torch.distributed._composable.fsdp._fsdp_state", "torch.distributed.fsdp._fully_shard._fsdp_state"):
    PATCH.on_import(_module)(_patch_fsdp2)

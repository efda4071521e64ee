"""module-state-dict-hooks: ``nn.Module.register_state_dict_post_hook`` and
``register_load_state_dict_pre_hook`` (the public state-dict hooks), torch 2.4.

What breaks:   torchtitan 0.3.0's fused ``wqkv`` (``FusedQKVLinear``, llama3's debug model) and other
               modules register their state-dict conversions with them when they are built: on torch
               2.4 ``AttributeError: 'FusedQKVLinear' object has no attribute
               'register_state_dict_post_hook'``.
Torch:         2.5 made both public. ``register_state_dict_post_hook(hook)``: ``hook(module, state_dict,
               prefix, local_metadata)`` modifies the state dict in place and must return None
               (``RuntimeError: state_dict post-hook must return None`` otherwise; the private
               ``_register_state_dict_hook`` of 2.4 took a returned dict as the new one, for the root module
               only, pytorch#117437). ``register_load_state_dict_pre_hook(hook)`` is 2.4's private
               ``_register_load_state_dict_pre_hook(hook, with_module=True)``: ``hook(module, state_dict,
               prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)``.
Fix:           serve both on ``nn.Module``: the post hook is kept in 2.4's ``_state_dict_hooks`` (run in
               registration order, as 2.5) through a call that raises 2.5's ``RuntimeError`` when it returns
               something; the pre hook is 2.4's private registration with the module. Both return the
               handle that removes them.
Upstream:      https://github.com/pytorch/pytorch/pull/117588 (register_state_dict_post_hook)
"""

from types import ModuleType
from typing import Any, Callable

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="module-state-dict-hooks",
    summary="nn.Module.register_state_dict_post_hook / register_load_state_dict_pre_hook (torch 2.5's public "
            "state-dict hooks)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/117588",
)
PATCH.sets("torch.nn.Module", ("register_state_dict_post_hook", "register_load_state_dict_pre_hook"))


def register_state_dict_post_hook(self: Any, hook: Callable[..., None]) -> Any:
    """Register ``hook(module, state_dict, prefix, local_metadata) -> None``, run after ``state_dict``."""
    from torch.utils.hooks import RemovableHandle

    def post_hook(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        if hook(module, state_dict, prefix, local_metadata) is not None:
            raise RuntimeError("state_dict post-hook must return None")

    handle = RemovableHandle(self._state_dict_hooks)
    self._state_dict_hooks[handle.id] = post_hook
    return handle


def register_load_state_dict_pre_hook(self: Any, hook: Callable[..., None]) -> Any:
    """Register ``hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
    error_msgs) -> None``, run before ``load_state_dict`` loads this module."""
    return self._register_load_state_dict_pre_hook(hook, with_module=True)


@PATCH.on_import("torch.nn.modules.module")
def serve(patcher: Patcher, module: ModuleType) -> bool:
    owner = module.Module
    missing = [f for f in (register_state_dict_post_hook, register_load_state_dict_pre_hook)
               if not hasattr(owner, f.__name__)]
    for function in missing:
        function.__qualname__ = f"Module.{function.__name__}"
        patcher.setattr(owner, function.__name__, function)
    return bool(missing)

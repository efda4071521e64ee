"""fsdp2-set-reshard-after-forward: ``FSDPModule.set_reshard_after_forward(reshard_after_forward,
recurse=True)`` on torch 2.4.

What breaks:   torchtitan 0.3.0's chunked loss keeps the output projection unsharded across its
               chunks (``lm_head.set_reshard_after_forward(False)``): on torch 2.4 every FSDP run stops
               in the first loss with ``AttributeError: 'FSDPLinear' object has no attribute
               'set_reshard_after_forward'``.
Torch:         2.6 added the setter: for the module (and, with ``recurse``, each FSDP submodule) the
               parameter group's post-forward mesh becomes ``_get_post_forward_mesh_info(value,
               mesh_info)`` (``None``: keep the parameters unsharded after forward), the same attribute
               2.4's ``fully_shard`` sets from its ``reshard_after_forward`` argument and 2.4's root lazy
               init clears; a non-bool raises ``ValueError``.
Fix:           serve the method doing that on 2.4's parameter groups. Not served: 2.6's
               ``_auto_reshard_after_forward`` flag, which keeps a root module's explicit setting through
               the lazy init; on 2.4 a root set before its first forward is still set to keep its
               parameters (its lazy init's choice), as 2.4 does for any root.
Upstream:      https://github.com/pytorch/pytorch/pull/139891 (set_reshard_after_forward)
"""

from types import ModuleType
from typing import Any

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-set-reshard-after-forward",
    summary="FSDPModule.set_reshard_after_forward(value, recurse=True) on torch 2.4 (the parameter groups' "
            "post-forward mesh)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/139891",
    errors=(  # FSDP's dynamic class (FSDP<module class>) lacks the method
        Error(r"object has no attribute 'set_reshard_after_forward'",
              "AttributeError: 'FSDPLinear' object has no attribute 'set_reshard_after_forward'"),
    ),
)
FSDP = "torch.distributed._composable.fsdp"
PATCH.sets(f"{FSDP}.fully_shard.FSDPModule", ("set_reshard_after_forward",))


def set_reshard_after_forward(self: Any, reshard_after_forward: bool, recurse: bool = True) -> None:
    """Set whether this module (and, with ``recurse``, its FSDP submodules) reshards its parameters
    after forward."""
    from torch.distributed._composable.fsdp._fsdp_init import _get_post_forward_mesh_info
    from torch.distributed._composable.fsdp.fully_shard import FSDPModule

    if not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
    for module in (list(self.modules()) if recurse else [self]):
        if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group):
            group.post_forward_mesh_info = _get_post_forward_mesh_info(reshard_after_forward, group.mesh_info)


@PATCH.on_import(f"{FSDP}.fully_shard")
def serve_method(patcher: Patcher, module: ModuleType) -> bool:
    owner = module.FSDPModule
    if hasattr(owner, "set_reshard_after_forward"):
        return False
    set_reshard_after_forward.__qualname__ = "FSDPModule.set_reshard_after_forward"
    patcher.setattr(owner, "set_reshard_after_forward", set_reshard_after_forward)
    return True

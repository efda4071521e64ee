"""fsdp-public: FSDP2's public names in ``torch.distributed.fsdp``, torch 2.4-2.5.

What breaks:   code written for torch >= 2.6 (torchtitan 2025, accelerate, transformers) does
               ``from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy``
               and dies with ``ImportError: cannot import name 'CPUOffloadPolicy' from
               'torch.distributed.fsdp'``.
Torch:         2.4 and 2.5 have FSDP2 only as ``torch.distributed._composable.fsdp``; 2.6 made it
               public in ``torch.distributed.fsdp`` (and keeps the old module).
Fix:           serve ``fully_shard``, ``FSDPModule``, ``MixedPrecisionPolicy``, ``OffloadPolicy``,
               ``CPUOffloadPolicy``, ``register_fsdp_forward_method`` and ``UnshardHandle`` on
               ``torch.distributed.fsdp`` as the very objects of the private module.
Upstream:      https://github.com/pytorch/pytorch/pull/141868 (FSDP2 public, torch 2.6)
"""

from typing import Any, Callable

from torchpatch import Patch

PATCH = Patch(
    id="fsdp-public",
    summary="torch.distributed.fsdp.fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, ... "
    "(FSDP2's public names)",
    torch=">=2.4,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/141868",
)

PUBLIC = ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
          "register_fsdp_forward_method", "UnshardHandle")


def _from_private(name: str) -> Callable[[], Any]:
    def factory() -> Any:
        import importlib

        package = importlib.import_module("torch.distributed._composable.fsdp")
        # UnshardHandle lives only in the submodule, which the package's ``fully_shard`` (the function) hides
        module = importlib.import_module("torch.distributed._composable.fsdp.fully_shard")
        return getattr(package, name) if hasattr(package, name) else getattr(module, name)

    return factory


for _name in PUBLIC:
    PATCH.symbol("torch.distributed.fsdp", _name)(_from_private(_name))

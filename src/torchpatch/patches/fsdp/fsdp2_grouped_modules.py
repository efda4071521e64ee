"""fsdp2-grouped-modules: ``fully_shard([module_a, module_b], ...)`` (a list of modules) on torch 2.4,
for modules that share no parameter.

What breaks:   torchtitan 0.3.0 shards its final norm and output projection as one group,
               ``fully_shard([model.norm, model.lm_head], ...)``: torch 2.4's ``fully_shard`` takes one
               module, and every FSDP run stops at ``AttributeError: 'list' object has no attribute
               '__dict__'``.
Torch:         2.6 takes a list: the modules' parameters form one FSDP group (one all-gather, one
               reduce-scatter), which is what lets modules that share a parameter (tied weights) be
               sharded together. 2.4's FSDP state belongs to one module.
Fix:           where the modules share no parameter, each is sharded by its own ``fully_shard`` call with
               the same arguments, in the list's order: each parameter gets the same shard, the same
               all-gathered value and the same reduce-scattered gradient (element-wise the same sums) as
               in 2.6's one group; only the collectives are split (two smaller ones instead of one).
               Modules that share a parameter (one group is what makes that right) raise
               ``NotImplementedError``: 2.6's grouped FSDP state is not served. Returns the list, as 2.6.
Upstream:      https://github.com/pytorch/pytorch/pull/127786 (fully_shard of a list of modules)
"""

import functools
from types import ModuleType
from typing import Any, Callable

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-grouped-modules",
    summary="fully_shard([module_a, module_b]) on torch 2.4: modules sharing no parameter sharded one by one "
            "(the same shards and gradients); shared parameters refused",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/127786",
    behaviour="fully_shard(list of modules)",
    errors=(  # 2.4's composable contract reads the module's __dict__
        Error(r"'(list|tuple)' object has no attribute '__dict__'",
              "AttributeError: 'list' object has no attribute '__dict__'"),
    ),
)
HOMES = ("torch.distributed._composable.fsdp.fully_shard", "torch.distributed._composable.fsdp",
         "torch.distributed.fsdp")


def _one_by_one(fully_shard: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fully_shard)
    def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(module, (list, tuple)):
            return fully_shard(module, *args, **kwargs)
        seen: dict = {}
        for index, each in enumerate(module):
            for param in each.parameters():
                if seen.setdefault(id(param), index) != index:
                    raise NotImplementedError(
                        f"fully_shard(list of modules): modules {seen[id(param)]} and {index} share a parameter; one "
                        "FSDP group over several modules (torch 2.6's grouped FSDP state) is not served on this "
                        "torch: shard their common parent instead")
        for each in module:
            fully_shard(each, *args, **kwargs)
        return module

    wrapper.__torchpatch_grouped__ = fully_shard  # type: ignore[attr-defined]
    return wrapper


def _patch_home(patcher: Patcher, home: ModuleType) -> bool:
    original = getattr(home, "fully_shard", None)
    if not callable(original) or isinstance(original, ModuleType) or hasattr(original, "__torchpatch_grouped__"):
        return False
    patcher.setattr(home, "fully_shard", _one_by_one(original))
    return True


for _home in HOMES:
    PATCH.on_import(_home)(_patch_home)

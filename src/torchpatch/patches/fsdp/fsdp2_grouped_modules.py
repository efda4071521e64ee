"""fsdp2-grouped-modules: ``fully_shard([module_a, module_b], ...)`` (a list of modules) on torch 2.4,
for modules that share no parameter.

What breaks:   torchtitan 0.2.2 and 0.3.0 shard their final norm and output projection as one
               group (``fully_shard([model.norm, model.output])``; 0.3.0's ``lm_head``): torch 2.4's
               ``fully_shard`` takes one module, and every FSDP run stops at ``AttributeError: 'list'
               object has no attribute '__dict__'``.
Torch:         2.5 takes a list: the modules' parameters form one FSDP group (one all-gather, one
               reduce-scatter; one FSDP state shared by the modules), which is what lets modules that
               share a parameter (tied weights) be sharded together; a listed module inside another
               listed one is part of that one; the call returns the list. 2.4's FSDP state belongs to
               one module.
Fix:           where the modules share no parameter, each is sharded by its own ``fully_shard`` call with
               the same arguments, in the list's order: each parameter gets the same shard, the same
               all-gathered value and the same reduce-scattered gradient (element-wise the same sums) as
               in 2.5's one group; only the collectives are split (two smaller ones instead of one).
               Modules that share a parameter (one group is what makes that right) raise
               ``NotImplementedError``: 2.5's grouped FSDP state is not served. A listed module inside
               another listed one is skipped (2.5's root modules of the list). Returns the list, as 2.5.
               What a caller sets on one module of a group acts on the group's every module, as on 2.5's
               one state: ``reshard``, ``unshard`` (one handle waiting for all), ``set_requires_gradient_sync``,
               ``set_requires_all_reduce``, ``set_reshard_after_backward``, ``set_reshard_after_forward``
               and ``set_gradient_divide_factor`` (the last two served on 2.4 by their patches) reach the
               other modules of the list (not recursively: their submodules are not the group). Not
               served: ``fully_shard.state(a) is fully_shard.state(b)`` (2.4 keeps one state per module).
Upstream:      https://github.com/pytorch/pytorch/pull/127786 (fully_shard of a list of modules)
"""

import functools
import inspect
import threading
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="fsdp2-grouped-modules",
    summary="fully_shard([module_a, module_b]) on torch 2.4: modules sharing no parameter sharded one by one "
            "(the same shards and gradients; a setter on one acts on the list's every module); shared "
            "parameters refused",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/127786",
    behaviour="fully_shard(list of modules)",
    errors=(  # 2.4's composable contract reads the module's __dict__
        Error(r"'(list|tuple)' object has no attribute '__dict__'",
              "AttributeError: 'list' object has no attribute '__dict__'"),
    ),
)
FSDP = "torch.distributed._composable.fsdp"
HOMES = (f"{FSDP}.fully_shard", FSDP, "torch.distributed.fsdp")
GROUP = "_torchpatch_fsdp_group"  # in a listed module's __dict__: the list's modules sharded together
# FSDPModule's methods that act on the module's own parameter group (2.5: the list's one group)
GROUP_METHODS = ("reshard", "unshard", "set_requires_gradient_sync", "set_requires_all_reduce",
                 "set_reshard_after_backward", "set_reshard_after_forward", "set_gradient_divide_factor")

_spreading = threading.local()  # .on: a group method is being applied to the other modules of a group
_group_methods: Dict[str, Callable[[], None]] = {}  # "wrap": wraps GROUP_METHODS once, on the first list


def _root_modules(modules: Sequence[Any]) -> List[Any]:
    """The listed modules that are not inside another listed one, each once, in the list's order."""
    roots: List[Any] = []
    for module in modules:
        if any(module is other for other in roots):
            continue
        if not any(module is sub for other in modules if other is not module for sub in other.modules()):
            roots.append(module)
    return roots


def _one_by_one(fully_shard: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fully_shard)
    def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(module, (list, tuple)):
            return fully_shard(module, *args, **kwargs)
        roots = _root_modules(module)
        seen: dict = {}
        for index, each in enumerate(roots):
            for param in each.parameters():
                if seen.setdefault(id(param), index) != index:
                    raise NotImplementedError(
                        f"fully_shard(list of modules): modules {seen[id(param)]} and {index} share a parameter; one "
                        "FSDP group over several modules (torch 2.5's grouped FSDP state) is not served on this "
                        "torch: shard their common parent instead")
        if len(roots) > 1 and (wrap := _group_methods.pop("wrap", None)) is not None:
            wrap()
        for each in roots:
            fully_shard(each, *args, **kwargs)
        if len(roots) > 1:
            for each in roots:
                each.__dict__[GROUP] = tuple(roots)
        return module

    wrapper.__torchpatch_grouped__ = fully_shard  # type: ignore[attr-defined]
    return wrapper


class _GroupHandle:
    """``unshard(async_op=True)`` of a group: waits for each module's handle."""

    def __init__(self, handles: List[Any]) -> None:
        self._handles = handles

    def wait(self) -> None:
        for handle in self._handles:
            if handle is not None:
                handle.wait()
        self._handles = []


def _whole_group(name: str, signature: inspect.Signature) -> Callable[..., Any]:
    def wrapper(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        group = getattr(instance, "__dict__", {}).get(GROUP)
        if not group or getattr(_spreading, "on", False):
            return result
        bound = signature.bind(instance, *args, **kwargs)
        if "recurse" in signature.parameters:  # the group's other modules, not their submodules
            bound.arguments["recurse"] = False
        _spreading.on = True
        try:
            others = [getattr(other, name)(*bound.args[1:], **bound.kwargs) for other in group if other is not instance]
        finally:
            _spreading.on = False
        if name == "unshard" and result is not None:
            return _GroupHandle([result, *others])
        return result

    return wrapper


def _patch_home(patcher: Patcher, home: ModuleType) -> bool:
    original = getattr(home, "fully_shard", None)
    if not callable(original) or isinstance(original, ModuleType) or hasattr(original, "__torchpatch_grouped__"):
        return False
    patcher.setattr(home, "fully_shard", _one_by_one(original))
    return True


for _home in HOMES:
    PATCH.on_import(_home)(_patch_home)


@PATCH.on_import(f"{FSDP}.fully_shard")
def keep_group_methods(patcher: Patcher, module: ModuleType) -> Optional[bool]:
    """FSDPModule's group methods are wrapped on the first fully_shard of a list of several modules (by
    then fsdp2-set-reshard-after-forward and fsdp2-gradient-divide-factor have served theirs), through
    this hook's patcher: undone with the patch."""
    owner = getattr(module, "FSDPModule", None)
    if owner is None:
        return False

    def wrap() -> None:
        for name in GROUP_METHODS:
            if callable(method := getattr(owner, name, None)):
                patcher.wrap(owner, name, _whole_group(name, inspect.signature(method)))

    _group_methods["wrap"] = wrap
    patcher.on_undo(lambda: _group_methods.pop("wrap", None))
    return True

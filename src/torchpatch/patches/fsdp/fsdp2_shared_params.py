"""fsdp2-shared-params: FSDP2 raises on a parameter shared by two FSDP groups (tied weights wrapped
separately), torch 2.4-2.12.

What breaks:   a model with tied weights (an embedding whose weight is also the output projection's,
               as in many LMs) whose two modules get separate ``fully_shard`` calls
               (``fully_shard(model.emb); fully_shard(model.out)``) trains without any error, but
               the two FSDP groups each shard the one parameter on their own: after the first
               ``fully_shard`` the embedding holds a new sharded parameter while the output layer
               still holds the original, which the second call shards again. The tie is silently
               broken: each copy gets only its own module's gradient, the optimizer steps two
               diverging tensors, and the weights drift away from what the same model trains to on
               one process (with uneven sharding, part of the weight never updates at all,
               pytorch#176076).
Torch:         every FSDP2 before 2.13 (read in 2.4.1's ``_composable/fsdp`` and 2.9.0's
               ``fsdp/_fully_shard``: nothing compares the parameters of different groups); torch
               2.13 stamps each original parameter with an id when FSDP2 takes it and raises at
               lazy init (the first forward) when two groups took the same one.
Fix:           as upstream: ``FSDPParam.__init__`` stamps the parameter it is given with an id (kept
               on the ``FSDPParam`` too), and the root's lazy init, where torch 2.13 checks (right
               after ``_init_shared_state``, which only the root's first lazy init calls: a step
               calls nothing here), raises torch 2.13's ``ValueError: Parameter '<fqn>' is shared
               with a parameter already managed by another FSDP group. For shared/tied parameters,
               use fully_shard([module_a, module_b]) to place them in the same FSDP group.`` when
               two ``FSDPParam``s of its tree hold the same id. Tied weights inside one FSDP group
               (one ``fully_shard`` over both modules, or the root's group) are one ``FSDPParam``
               and pass. Applied only where ``FSDPState`` lacks ``_validate_no_duplicate_params``.
Upstream:      https://github.com/pytorch/pytorch/pull/176225 (issue
               https://github.com/pytorch/pytorch/issues/176076)
"""

import itertools
from typing import Any, Dict, Iterator, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="fsdp2-shared-params",
    summary="FSDP2 raises on a parameter shared by two FSDP groups (torch < 2.13 silently trained two copies of a tied weight)",
    torch=">=2.4,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/176225",
    behaviour="fully_shard on modules with tied weights in separate FSDP groups",
    category="correctness",
)

_UIDS = itertools.count()
_STAMP = "_torchpatch_fsdp_param_uid"  # on the original nn.Parameter FSDP2 was given
_OWN = "_torchpatch_orig_param_uid"  # on the FSDPParam made from it


def _init_param(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    param = args[0] if args else kwargs["param"]
    uid = getattr(param, _STAMP, None)
    if uid is None:
        uid = next(_UIDS)
        setattr(param, _STAMP, uid)
    result = wrapped(*args, **kwargs)
    setattr(instance, _OWN, uid)
    return result


def _fsdp_params(state: Any) -> Iterator[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch 2.4-2.5: one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    for group in groups:
        yield from group.fsdp_params


def _init_shared_state(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """The root's lazy init, once (where torch 2.13 validates): no two groups of its tree hold one parameter."""
    result = wrapped(*args, **kwargs)
    seen, states = set(), {id(state): state for state in instance._state_ctx.all_states}
    for state in states.values():  # torch 2.9 lists a grouped fully_shard([a, b])'s state once per module
        for fsdp_param in _fsdp_params(state):
            uid = getattr(fsdp_param, _OWN, None)
            if uid is None:
                continue
            if uid in seen:
                raise ValueError(
                    f"Parameter '{fsdp_param._param_fqn}' is shared with a parameter already managed by another "
                    "FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) to place them "
                    "in the same FSDP group.")
            seen.add(uid)
    return result


def _patch_fsdp2(patcher: Patcher, state_module: Any) -> bool:
    import importlib

    if hasattr(state_module.FSDPState, "_validate_no_duplicate_params"):
        return False  # torch >= 2.13 checks itself
    param_module = importlib.import_module(state_module.__name__.rsplit(".", 1)[0] + "._fsdp_param")
    patcher.wrap(param_module.FSDPParam, "__init__", _init_param)
    patcher.wrap(state_module.FSDPState, "_init_shared_state", _init_shared_state)
    return True


# FSDP2's home: torch 2.4-2.5, then torch >= 2.6 (whose _composable/fsdp keeps no _fsdp_state)
for _module in ("torch.distributed._composable.fsdp._fsdp_state", "torch.distributed.fsdp._fully_shard._fsdp_state"):
    PATCH.on_import(_module)(_patch_fsdp2)

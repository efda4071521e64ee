"""dtensor-strided-shard-pointwise: ``param.copy_(replicated)`` into an FSDP+TP parameter puts rows on the
wrong ranks, torch 2.9-2.11.

What breaks:   DTensor's pointwise strategy (``common_pointwise_strategy``, which ``copy_``, ``add``,
               ``mul`` and the foreach ops use) turns a ``_StridedShard(d, split_factor)`` placement
               into ``Shard(d)`` for its output and for the placements the other operands are
               redistributed to. FSDP2 labels a parameter that TP already shards on the same tensor
               dim ``(_StridedShard(0, sf=tp), Shard(0))`` on the (dp, tp) mesh; ``param.copy_(src)``
               with a replicated ``src`` (``nn.Module.load_state_dict`` of a value that a state-dict
               hook gathered: torchtitan 0.3.0's fused ``wqkv``, loaded from the seed checkpoint)
               copies ``src``'s ``(Shard(0), Shard(0))`` chunk: on dp 2 x tp 2 the ranks (dp 0, tp 1)
               and (dp 1, tp 0) get each other's rows. ``dt + replicated`` computes with the wrong
               rows, and ``dt * 2`` is labelled ``(Shard(0), Shard(0))`` (its ``full_tensor()`` is
               out of order). No error, no warning (torchtitan 0.3.0's fsdp+tp+sac on 2.9.0 started
               from other weights than one process and trained 6.5e-3 off it).
Torch:         torch 2.9.0 natively; torch 2.13.0, 2.14.1 and 2.15.0 keep the ``_StridedShard``
               (their ``map_placements_after_broadcast`` maps it with its split factor), as 2.12's
               single-dim rules do. A torch whose ``map_placements_after_broadcast`` keeps it, or
               without ``common_pointwise_strategy``, is left alone.
Fix:           each sharding the pointwise strategy returns has ``Shard(d)`` replaced by
               ``_StridedShard(d, split_factor)`` on every mesh dim where the operand it follows is
               ``_StridedShard``: its output and the placements its other operands are redistributed
               to (this torch's redistribution to and from ``_StridedShard`` is right where the
               shards are even). Where they are not (a tensor dim not divisible by the ranks sharding
               it), this torch's ``_StridedShard`` splits in another order than FSDP2 stores the
               shards, so a redistribution into it (from Replicate, Partial or another dim) raises
               ``NotImplementedError`` instead of copying wrong rows (natively: a size-mismatch error
               or wrong rows).
Upstream:      https://github.com/pytorch/pytorch/pull/167887 (``_StridedShard`` no longer a ``Shard``;
               the strategies map it with its split factor)
"""

import inspect
from types import ModuleType
from typing import Any, Callable, Dict, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._reexport import reexport
from torchpatch.patches.dtensor._internals import (
    STRIDED_POINTWISE_DONE, forget_shardings, maps_strided_shard, strided_shard_type
)

PATCH = Patch(
    id="dtensor-strided-shard-pointwise",
    summary="DTensor pointwise ops (copy_, add, mul) keep a _StridedShard operand's placement instead of "
    "treating it as Shard (FSDP+TP parameters loaded from a replicated value got other ranks' rows)",
    torch=">=2.9,<2.12",
    upstream="https://github.com/pytorch/pytorch/pull/167887",
    behaviour="fsdp_tp_param.copy_(replicated), strided + replicated, strided * 2",
    category="correctness",
)

def _restrided(spec: Any, strided_at: Dict[int, Any], shard: type, strided: type) -> Any:
    """``spec`` with ``Shard(d)`` on the mesh dims of ``strided_at`` made ``_StridedShard(d, sf)``."""
    if spec is None or not any(type(p) is shard for i, p in enumerate(spec.placements) if i in strided_at):
        return spec
    placements = tuple(
        strided(p.dim, split_factor=strided_at[i].split_factor) if i in strided_at and type(p) is shard else p
        for i, p in enumerate(spec.placements))
    return type(spec)(mesh=spec.mesh, placements=placements, tensor_meta=spec.tensor_meta)


def _refuse_uneven(current: Any, target: Any, shard: type, strided: type) -> None:
    """This torch splits a tensor dim unevenly sharded by a ``_StridedShard`` in another order than
    FSDP2 stores it: a redistribution into one (from Replicate, Partial, another dim) is refused."""
    for i, p in enumerate(target.placements):
        if not isinstance(p, strided):
            continue
        now = current.placements[i]
        if isinstance(now, shard) and now.dim == p.dim:
            continue  # no data moves on this mesh dim
        ranks = 1
        for j, q in enumerate(target.placements):
            if isinstance(q, shard) and q.dim == p.dim:
                ranks *= target.mesh.size(j)
        pieces = target.mesh.size(i) * p.split_factor  # what this torch's _StridedShard splits into
        if target.shape[p.dim] % ranks or target.shape[p.dim] % pieces:
            raise NotImplementedError(
                f"DTensor redistribution from {tuple(current.placements)} to {tuple(target.placements)} of a "
                f"tensor of shape {tuple(target.shape)} (dim {p.dim}: {target.shape[p.dim]} not divisible by "
                f"{max(ranks, pieces)}): this torch's _StridedShard splits uneven shards in another order than FSDP2 "
                "stores them (torch 2.13+ splits them right); torchpatch refuses it rather than copy wrong rows")


def _keeping_strided(signature: inspect.Signature, shard: type, strided: type) -> Callable[..., Any]:
    def common_pointwise_strategy(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                                  kwargs: Dict[str, Any]) -> Any:
        result = wrapped(*args, **kwargs)
        arguments = signature.bind(*args, **kwargs).arguments
        followed = arguments["followed_strategy"]
        operands = [arg for arg in arguments["args_schema"] if hasattr(arg, "strategies")]
        for op_spec, followed_spec in zip(result.strategies, followed.strategies):
            strided_at = {i: p for i, p in enumerate(followed_spec.output_spec.placements) if isinstance(p, strided)}
            if not strided_at:
                continue
            op_spec.output_specs = _restrided(op_spec.output_specs, strided_at, shard, strided)
            if op_spec.input_specs is not None:
                op_spec.input_specs = [_restrided(s, strided_at, shard, strided) for s in op_spec.input_specs]
                for operand, target in zip(operands, op_spec.input_specs):
                    if target.tensor_meta is not None:
                        _refuse_uneven(operand.strategies[0].output_spec, target, shard, strided)
        return result

    return common_pointwise_strategy


@PATCH.on_import("torch.distributed.tensor._ops._pointwise_ops")
def keep_strided_shards(patcher: Patcher, pointwise: ModuleType) -> bool:
    import importlib

    strategy = getattr(pointwise, "common_pointwise_strategy", None)
    strided = strided_shard_type()
    if strategy is None or strided is None or getattr(pointwise, STRIDED_POINTWISE_DONE, False):
        return False  # 2.12's single-dim rules
    from torch.distributed.tensor.placement_types import Shard

    if not issubclass(strided, Shard) or "followed_strategy" not in inspect.signature(strategy).parameters:
        return False
    if maps_strided_shard(importlib.import_module("torch.distributed.tensor._ops.utils"), strided):
        return False  # the upstream fix
    patcher.wrap(pointwise, "common_pointwise_strategy", _keeping_strided(inspect.signature(strategy), Shard, strided))
    patcher.setattr(pointwise, STRIDED_POINTWISE_DONE, True)
    forget_shardings()
    return True


# torch 2.15's torch.distributed.tensor re-exports the placement (2.9 has it in placement_types only)
PATCH.symbol("torch.distributed.tensor", "_StridedShard")(reexport("torch.distributed.tensor.placement_types", "_StridedShard"))

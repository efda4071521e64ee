"""dtensor-strided-shard-uneven: ``full_tensor()`` of an FSDP+TP parameter whose rows do not divide by
the ranks returns rows in the wrong order, torch 2.9-2.11.

What breaks:   FSDP2 over TP shards a parameter on one tensor dim twice: TP's chunk first, then the
               data-parallel chunk of that (labelled ``(_StridedShard(d, split_factor=tp), Shard(d))``
               on the (dp, tp) mesh). Where the dim does not divide by dp x tp, torch 2.9's
               ``_StridedShard`` splits (``distribute_tensor``, a redistribution into it) and gathers
               (``full_tensor()``, ``redistribute`` to ``Replicate`` or another layout) in another order
               than FSDP2 stores the shards, and its redistribution plans size the TP gather from the
               wrong logical shape: on dp 2 x tp 2, a weight of 10 rows comes back from ``full_tensor()``
               with rows padded, lost and out of order. No error, no warning (torchtitan 0.3.0's fused
               ``wqkv`` state-dict hook gathers ``wqkv`` so: its checkpoint would hold wrong rows).
               Even shards are right, and FSDP2's own steps use the local shards (right).
Torch:         2.9.0 (measured); torch 2.13.0-2.15.0 split ``_StridedShard`` TP-chunk first, as FSDP2
               stores it (pytorch#163843). 2.10-2.11 are not measured: a torch whose
               ``_StridedShard._split_tensor`` already splits so is left alone. 2.5-2.8 are not in the
               matrix (not patched).
Fix:           a refusal, not a backport of 163843's new ``_StridedShard``: a redistribution that moves
               data on the mesh dims of an uneven ``_StridedShard`` group (the strided dim and the
               ``Shard`` dims of the same tensor dim after it), from or to it, and ``_StridedShard``'s
               split of an uneven dim, raise ``NotImplementedError`` saying so. Checked when the
               redistribution's plan is made (cached per pair of specs), not per call.
Upstream:      https://github.com/pytorch/pytorch/pull/163843 (uneven ``_StridedShard`` split TP-first)
"""

from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import strided_shard_type, wrap_transform_plan

PATCH = Patch(
    id="dtensor-strided-shard-uneven",
    summary="full_tensor()/redistribute of an FSDP+TP (_StridedShard) tensor dim that does not divide by the "
    "ranks is refused (torch 2.9 gathers and splits its rows in the wrong order)",
    torch=">=2.9,<2.12",
    upstream="https://github.com/pytorch/pytorch/pull/163843",
    behaviour="uneven_fsdp_tp_param.full_tensor(), redistribute(...), distribute_tensor(..., _StridedShard)",
    category="correctness",
)

_WHY = ("this torch's _StridedShard splits and gathers uneven shards in another order than FSDP2 stores them "
        "(torch 2.13+ splits them TP-chunk first, pytorch#163843); torchpatch refuses it rather than return "
        "wrong rows")


def splits_tp_first(strided: type) -> bool:
    """Whether this torch's ``_StridedShard`` splits an uneven dim as FSDP2 over TP stores it: 6 rows,
    2 TP chunks (0-2, 3-5), each in 2: the first data-parallel shard holds rows 0, 1, 3, 4."""
    import torch

    shards, _ = strided(0, split_factor=2)._split_tensor(torch.arange(6), 2, with_padding=False)
    return shards[0].tolist() == [0, 1, 3, 4]


def uneven_groups(spec: Any, strided: type) -> List[Tuple[int, List[int]]]:
    """``(tensor dim, mesh dims)`` of each ``_StridedShard`` of ``spec`` on a tensor dim that does not
    divide by its ranks: the strided mesh dim and the plain ``Shard`` mesh dims of that tensor dim after it."""
    groups: List[Tuple[int, List[int]]] = []
    if spec.tensor_meta is None:
        return groups
    for i, p in enumerate(spec.placements):
        if not isinstance(p, strided):
            continue
        dims = [i] + [m for m, q in enumerate(spec.placements) if m > i and type(q) is not strided
                      and q.is_shard(p.dim)]
        ranks = 1
        for m in dims:
            ranks *= spec.mesh.size(m)
        rows = spec.shape[p.dim]
        if rows % ranks or rows % (spec.mesh.size(i) * p.split_factor):
            groups.append((p.dim, dims))
    return groups


def _check_plan(src: Any, dst: Any, plan: List[Any], strided: type) -> None:
    moved = {info.mesh_dim for info in plan}
    for spec in (src, dst):
        for dim, dims in uneven_groups(spec, strided):
            if moved.intersection(dims):
                raise NotImplementedError(
                    f"DTensor redistribution from {tuple(src.placements)} to {tuple(dst.placements)} of a tensor of "
                    f"shape {tuple(src.shape)} (dim {dim}, sharded by mesh dims {dims}, does not divide by its "
                    f"ranks): {_WHY}")


def _refusing_plan(strided: type) -> Callable[..., Any]:
    def plan(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """``_gen_transform_infos(src_spec, dst_spec)``, made once per pair of specs (a refusal is not cached)."""
        result = wrapped(*args, **kwargs)
        _check_plan(*(args + tuple(kwargs.values()))[:2], result, strided)
        return result

    return plan


def _split(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``_StridedShard._split_tensor(tensor, num_chunks, ...)`` (``distribute_tensor``, a split into it)."""
    tensor, num_chunks = args[:2] if len(args) > 1 else (args[0], kwargs["num_chunks"])
    rows, pieces = tensor.size(instance.dim), num_chunks * instance.split_factor
    if rows % pieces:
        raise NotImplementedError(
            f"splitting dim {instance.dim} of a tensor of shape {tuple(tensor.shape)} by {instance!r} over "
            f"{num_chunks} ranks ({rows} does not divide by {pieces}): {_WHY}")
    return wrapped(*args, **kwargs)


@PATCH.on_import("torch.distributed.tensor._redistribute")
def refuse_uneven_strided(patcher: Patcher, redistribute: ModuleType) -> bool:
    strided = strided_shard_type()
    if strided is None or splits_tp_first(strided):
        return False
    if not wrap_transform_plan(patcher, redistribute, _refusing_plan(strided)):
        return False  # a torch without a plan cache: not this patch's torch
    patcher.wrap(strided, "_split_tensor", _split)
    return True

"""dtensor-empty-shard-reduction: ``amax``/``amin``/``max()``/``argmax``/inf-norms of a DTensor with an
empty shard raise on every rank instead of raising on one and hanging the others, torch 2.4 and later.

What breaks:   a reduction over a sharded dimension of a DTensor whose shard is empty on some rank
               (uneven sharding: a tensor of 1 row ``Shard(0)`` over 2 ranks, 3 rows over 4 ranks,
               5 over 4) reduced over that dimension or over all dimensions: the reduction runs
               on each rank's shard, and an empty shard has no maximum. That rank raises
               (``IndexError: amax(): Expected reduction dim 0 to have non-zero size.``,
               ``RuntimeError: max(): Expected reduction dim to be specified for input.numel() ==
               0. ...``) and the other ranks go on to the next collective, where they wait for it
               until the process group's timeout (30 minutes by default), or die when its process
               exits.
Torch:         every torch tried, torch 2.15.0 too, for the reductions whose sharding strategy
               reduces each shard (``amax``, ``amin``, ``max()``, ``min()``, ``argmax``,
               ``argmin``, over the sharded dim or all dims; ``max()``/``min()`` on 2.4.1; the
               inf and -inf norms of ``linalg.vector_norm`` and ``_foreach_norm``, which
               ``clip_grad_norm_(norm_type=inf)`` takes of every gradient). Torch
               2.13 and later gather the reduced dim first for ``max(dim)``, ``min(dim)`` and
               ``aminmax`` (a value: torchpatch's dtensor-reduction-strategy does so on 2.4-2.12,
               dtensor-op-fallback for the ops 2.4-2.12 have no strategy for), and those stay as
               they are. No release fixes it; upstream has no issue for it.
Fix:           where DTensor decides an op's sharding (``propagate_op_sharding_non_cached``, on a
               sharding-cache miss only: once per op schema, never again once cached), for these
               reductions the shard each rank gets of the input, as it will be computed on, is
               worked out from the global shape and the placements (every rank knows both, no
               collective). If some rank's shard is empty, the op is run on an empty tensor of
               that rank's shape (2.13+'s argmax/argmin: the ``torch.max``/``torch.min`` their
               handler runs first), and the error it raises there (the first such rank's) is
               raised on every rank: torch's words, then a note, as torch's exception type (a
               subclass named as it, ``except IndexError`` catches it, which DTensor's dispatcher
               lets through instead of wrapping it in "Sharding propagation failed"). A refusal is
               never cached, so it is raised on every call. ``_StridedShard`` placements, and
               anything this cannot work out, are left to torch.
Upstream:      none (fixed in no release)
"""

import itertools
import sys
from types import ModuleType
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches.dtensor._internals import DISPATCH_MODULES, passing_dispatch, route_sharding_cache

PATCH = Patch(
    id="dtensor-empty-shard-reduction",
    summary="DTensor amax/amin/max()/argmax/inf-norm over a dim whose shard is empty on some rank raise "
    "torch's error on every rank instead of raising on one and hanging the others",
    torch=">=2.4",
    upstream="",
    behaviour="distribute_tensor(1 row, Shard(0)) over 2 ranks .amax(0) / .max() / .argmax()",
    category="correctness",
)

# the reductions that run on each rank's shard and raise on an empty one (max.dim, min.dim and
# aminmax too, where a torch or a patch leaves their reduced dim sharded)
_OPS = (("amax", "default"), ("amin", "default"), ("max", "default"), ("min", "default"), ("max", "dim"),
        ("min", "dim"), ("argmax", "default"), ("argmin", "default"), ("aminmax", "default"),
        ("linalg_vector_norm", "default"), ("_foreach_norm", "Scalar"))  # these two: ord=inf/-inf only
_ops: Dict[str, FrozenSet[Any]] = {}


def _reductions() -> FrozenSet[Any]:
    if "ops" not in _ops:
        import torch

        found = (getattr(getattr(torch.ops.aten, name, None), overload, None) for name, overload in _OPS)
        _ops["ops"] = frozenset(op for op in found if op is not None)
    return _ops["ops"]


def _is_spec(x: Any) -> bool:
    return hasattr(x, "placements") and hasattr(x, "tensor_meta") and hasattr(x, "mesh")


def _local_shapes(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Any]) -> Optional[List[List[int]]]:
    """Each rank's (in the mesh's order) local shape of a tensor of global ``shape``, split as torch
    splits a ``Shard`` (chunks of ceil(size / n), the last ones short or empty); None where a
    placement is not one this knows (``_StridedShard``)."""
    ndim = len(shape)
    shapes = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        local = list(shape)
        for mesh_dim, p in enumerate(placements):
            if not p.is_shard():
                continue
            if type(p).__name__ != "Shard" or not ndim:
                return None
            d, n = p.dim % ndim, mesh_shape[mesh_dim]
            full = -(-local[d] // n)
            start = full * coord[mesh_dim]
            local[d] = max(0, min(local[d], start + full) - start)
        shapes.append(local)
    return shapes


def _empty_shard_error(op_schema: Any, spec_schema: Any, local_op: Callable[..., Any]) -> Optional[BaseException]:
    """The error ``local_op`` (the op, or what its handler runs on the shard) raises on the first
    rank whose shard of the input (as ``spec_schema`` places it) is empty, made to reach the caller
    of the op as it is, or None."""
    args, kwargs = tuple(spec_schema.args_schema), dict(spec_schema.kwargs_schema)
    listed = bool(args) and isinstance(args[0], (list, tuple))  # a foreach op's tensors
    specs = list(args[0]) if listed else list(args[:1])
    if not specs or not all(_is_spec(x) for x in specs) or any(_is_spec(x) for x in args[1:] + tuple(kwargs.values())):
        return None
    import torch

    for spec in specs:
        meta = spec.tensor_meta
        if meta is None or 0 in meta.shape or not any(p.is_shard() for p in spec.placements):
            continue  # a globally empty tensor raises on every rank anyway
        for rank, shape in enumerate(_local_shapes(list(meta.shape), list(spec.mesh.shape), spec.placements) or ()):
            if 0 not in shape:
                continue
            empty = torch.empty(shape, dtype=meta.dtype)
            try:
                local_op([empty] if listed else empty, *args[1:], **kwargs)
            except Exception as exc:  # the error that rank would raise alone
                note = (f" (torchpatch dtensor-empty-shard-reduction: the shard of rank {rank} of the mesh is empty, "
                        f"{tuple(shape)} of {tuple(meta.shape)} placed {tuple(spec.placements)}: torch raises this "
                        "there alone, and the other ranks wait in their next collective.)")
                try:
                    return passing_dispatch(type(exc), op_schema.op)(f"{exc}{note}")
                except Exception:
                    return exc
    return None


def _handler_op(op: Any) -> Optional[Callable[..., Any]]:
    """What DTensor's own handler of ``op`` runs on each rank's shard, whatever the sharding
    propagation says, or None where ``op`` has no handler: torch 2.13+'s argmax/argmin handler
    first takes ``torch.max``/``torch.min`` of the shard (over ``dim``, kept, where one is given)."""
    api = sys.modules.get("torch.distributed.tensor._api") or sys.modules.get("torch.distributed._tensor.api")
    dispatcher = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
    if op not in (getattr(dispatcher, "_custom_op_handlers", None) or {}):
        return None
    redux = sys.modules.get("torch.distributed.tensor._nonlinear_redux")
    value_op = getattr(redux, "_ARGMINMAX_REDUCTION_OPS", {}).get(op)
    if value_op is None:
        return None

    def local_op(tensor: Any, dim: Any = None, keepdim: bool = False) -> Any:
        return value_op(tensor) if dim is None else value_op(tensor, dim=dim, keepdim=True)

    return local_op


def _propagate(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ShardingPropagator.propagate_op_sharding_non_cached`` (only on a sharding-cache miss)."""
    sharding = wrapped(*args, **kwargs)
    op_schema = args[0] if args else kwargs["op_schema"]
    op = getattr(op_schema, "op", None)
    if op not in _reductions():
        return sharding
    try:
        handler_op = _handler_op(op)
        if handler_op is not None:  # the handler computes on the shards as they are
            error = _empty_shard_error(op_schema, op_schema, handler_op)
        else:  # the op runs on the shards the propagation chose
            error = _empty_shard_error(op_schema, getattr(sharding, "redistribute_schema", None) or op_schema, op)
    except Exception:  # fail safe: anything this does not know is left to torch
        return sharding
    if error is not None:
        raise error from None
    return sharding


def _refuse_in_propagation(patcher: Patcher, dispatch: ModuleType) -> bool:
    propagator = getattr(dispatch, "ShardingPropagator", None)
    cls = getattr(dispatch, "OpDispatcher", None)
    if cls is None or cls.__module__ != dispatch.__name__:  # absent, or re-exported from elsewhere
        return False
    if propagator is None or not hasattr(propagator, "propagate_op_sharding_non_cached"):
        return False
    if getattr(propagator, "_torchpatch_empty_shard_checked", False):
        return False
    patcher.wrap(propagator, "propagate_op_sharding_non_cached", _propagate)
    patcher.setattr(propagator, "_torchpatch_empty_shard_checked", True)
    api = sys.modules.get("torch.distributed.tensor._api") or sys.modules.get("torch.distributed._tensor.api")
    existing = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
    if existing is not None:  # DTensor imported before torchpatch was installed
        route_sharding_cache(patcher, existing.sharding_propagator)
    return True


for _module in DISPATCH_MODULES:
    PATCH.on_import(_module)(_refuse_in_propagation)

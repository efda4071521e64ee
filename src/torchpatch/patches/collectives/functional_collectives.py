"""functional-collectives: ``torch.distributed._functional_collectives`` where torch lacks it or some of
its functions, torch 1.13 and later.

What breaks:   OpenDiT's async sequence parallel runs
               ``from torch.distributed._functional_collectives import all_gather_tensor, reduce_scatter_tensor``
               and on torch 1.13 dies with
               ``ModuleNotFoundError: No module named 'torch.distributed._functional_collectives'``; code
               written for newer torch dies on 2.1 with ``ImportError: cannot import name
               'all_to_all_single' from 'torch.distributed._functional_collectives'``.
Torch:         of the ten functions served here (all_reduce, all_gather_tensor, reduce_scatter_tensor,
               all_to_all_single, all_gather_into_tensor_coalesced, reduce_scatter_tensor_coalesced,
               all_reduce_coalesced, wait_tensor, broadcast, permute_tensor), torch lacks
                   1.13.1         the whole module (it arrived in 2.0)
                   2.1.2          all_to_all_single, broadcast, permute_tensor
                   2.4.1, 2.9.0   none, nor do 2.13.0 (the reference), 2.14.1 and 2.15.0
               Torch 2.13 renamed six of them (the old names warn FutureWarning from 2.13 on):
               all_gather_single (all_gather_tensor), reduce_scatter_single (reduce_scatter_tensor),
               their ``*_autograd`` forms (all_gather_tensor_autograd, reduce_scatter_tensor_autograd,
               which torch 2.4 has), all_gather_single_coalesced (all_gather_into_tensor_coalesced),
               reduce_scatter_single_coalesced (reduce_scatter_tensor_coalesced): every torch before
               2.13 lacks the new names. 2.15 added ``wait_tensors(tensors)`` (the waited tensors of a
               multi-output collective), which every older torch lacks.
Fix:           where the module is missing, serve it with all ten; where it exists, serve only the
               functions it lacks (torch's own are never replaced). The new names are the module's
               own function of the old name (torch's where it has it, this patch's where it is served);
               the two ``*_autograd`` names are the plain function, as in 2.13 (``all_gather_single_autograd``
               calls ``all_gather_single``), differentiable on 2.4-2.12 through funcol-autograd (torch 2.4's
               own ``all_gather_tensor_autograd`` fails in backward now and then on gloo: "A view was
               created in no_grad mode ..."), and this patch's differentiable function before 2.4;
               ``wait_tensors`` is the module's ``wait_tensor`` of each tensor. Signatures are torch 2.13's; behaviour:
               - Synchronous: each call finishes its collective and returns a new plain tensor (torch
                 returns an AsyncCollectiveTensor that waits on first use); ``wait_tensor`` returns its
                 argument. Inputs are never modified.
               - ``group``: a ProcessGroup; a list of ranks, resolved as torch does to an existing group
                 with exactly those ranks (the world group included); a list of equal-size rank lists,
                 whose groups are made with ``dist.new_group`` on first use and cached, so that first use
                 is collective over every rank of the default group; a 1-D DeviceMesh or (DeviceMesh, dim)
                 (torch >= 2.1). ``tag`` is accepted and ignored (torch deprecated it).
               - Differentiable as in torch 2.13: all_gather and reduce_scatter("sum") are each other's
                 backward, all_reduce("sum") its own, all_to_all_single the one with swapped splits (other
                 reductions raise in backward, as torch 2.13's do; torch 2.14 differentiates
                 all_reduce("avg") too, 2.15 also "min" and "max"); broadcast's gradient is the sum of the
                 output gradients on the source rank and zero elsewhere (torch 2.13 has none registered
                 and warns while passing gradients through unchanged). Usable inside a custom
                 ``autograd.Function``'s forward and backward.
               - gloo (1.13, 2.1) has no all_gather_into_tensor, reduce_scatter or AVG: for gloo and CPU
                 tensors a gather goes through ``all_gather`` into a list, a reduce-scatter through
                 ``all_reduce`` and a slice, an average through a sum and a division, the detours torch
                 2.1's own functional collectives take; other backends (nccl) use
                 all_gather_into_tensor and reduce_scatter_tensor. ``permute_tensor`` permutes along dim 0
                 for any shape (torch 2.13 takes 1-D tensors only). The coalesced functions run one
                 collective per tensor.
Upstream:      the functional collectives RFC https://github.com/pytorch/pytorch/issues/93173;
               all_to_all_single https://github.com/pytorch/pytorch/pull/106655; permute_tensor
               https://github.com/pytorch/pytorch/pull/115078
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from torchpatch import Patch

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

MODULE = "torch.distributed._functional_collectives"

PATCH = Patch(
    id="functional-collectives",
    summary="torch.distributed._functional_collectives where it is missing (1.13), its missing functions elsewhere "
    "(2.1: all_to_all_single, broadcast, permute_tensor; before 2.13: the *_single names of torch 2.13; before "
    "2.15: wait_tensors)",
    torch=">=1.13",
    upstream="https://github.com/pytorch/pytorch/issues/93173",
)

_REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")
_nested_groups: Dict[Tuple[Tuple[int, ...], ...], "ProcessGroup"] = {}


# -- groups ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _device_mesh_class() -> Optional[type]:
    """DeviceMesh: torch.distributed.device_mesh from 2.2, torch.distributed._tensor on 2.1, none before."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        try:
            from torch.distributed._tensor import DeviceMesh  # type: ignore[no-redef]
        except ImportError:
            return None
    return DeviceMesh


def _live_groups() -> Dict[Any, Dict[int, int]]:
    """c10d's registry of live groups, in creation order: group -> {global rank: group rank}."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._world.pg_group_ranks if hasattr(c10d, "_world") else c10d._pg_group_ranks  # 1.13: no _world


def _existing_group(ranks: List[int]) -> "ProcessGroup":
    """The first group made (the world group comes first) whose ranks are exactly ``ranks``."""
    import torch.distributed as dist

    me, wanted = dist.get_rank(), sorted(ranks)
    if me not in wanted:
        raise ValueError(f"rank {me} is not in the group ranks {ranks}")
    for pg, global_to_group in list(_live_groups().items()):
        if isinstance(pg, dist.ProcessGroup) and sorted(global_to_group) == wanted:
            return pg
    raise ValueError(
        f"no process group with ranks {wanted} exists: create it with torch.distributed.new_group({wanted}) "
        "on every rank and pass the group (a list of ranks names an existing group, as in torch)"
    )


def _nested_group(mesh: List[List[int]]) -> "ProcessGroup":
    """This rank's group among equal-size rank lists; all are made on first use (collectively)."""
    import torch.distributed as dist

    key = tuple(tuple(sorted(ranks)) for ranks in mesh)
    if len({len(ranks) for ranks in key}) != 1:
        raise ValueError(f"group sizes must be identical, got {mesh}")
    me = dist.get_rank()
    mine = [ranks for ranks in key if me in ranks]
    if len(mine) != 1:
        raise ValueError(f"rank {me} must be in exactly one of the rank lists {mesh}")
    if _nested_groups.get(key) not in _live_groups():  # not made yet, or destroyed since
        made = [dist.new_group(list(ranks)) for ranks in key]  # every rank makes every group, in order
        _nested_groups[key] = made[key.index(mine[0])]
    return _nested_groups[key]


def _mesh_group(mesh: Any, dim: int) -> "ProcessGroup":
    get_group = getattr(mesh, "get_group", None) or mesh.get_dim_groups  # torch 2.1: get_dim_groups
    return get_group(dim)


def _process_group(group: Any) -> "ProcessGroup":
    """Resolve the ``group`` forms torch's functional collectives take to one ProcessGroup."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, list) and group and all(isinstance(ranks, list) for ranks in group):
        return _nested_group(group)
    if isinstance(group, list) and group and all(isinstance(rank, int) for rank in group):
        return _existing_group(group)
    mesh_class = _device_mesh_class()
    if mesh_class is not None and isinstance(group, mesh_class):
        if group.ndim != 1:
            raise ValueError("Only 1D mesh is supported, pass in (DeviceMesh, int) together if mesh > 1D")
        return _mesh_group(group, 0)
    if (mesh_class is not None and isinstance(group, tuple) and len(group) == 2
            and isinstance(group[0], mesh_class) and isinstance(group[1], int)):
        return _mesh_group(*group)
    raise ValueError(
        f"Unsupported group {group!r}: pass a ProcessGroup, a list of ranks, a list of rank lists"
        + (", a DeviceMesh or (DeviceMesh, dim)" if mesh_class is not None else " (this torch has no DeviceMesh)")
    )


# -- collectives on dim 0, without autograd ------------------------------------------------------------
def _detour(pg: "ProcessGroup", tensor: "torch.Tensor") -> bool:
    """gloo lacks all_gather_into_tensor, reduce_scatter and AVG (torch 2.1's funcol checks the same)."""
    import torch.distributed as dist

    return tensor.device.type == "cpu" or dist.get_backend(pg) == dist.Backend.GLOO


def _reduce_op(name: str) -> Any:
    import torch.distributed as dist

    if name.lower() not in _REDUCE_OPS:
        raise ValueError(f"Invalid reduce operation {name!r}; one of {', '.join(_REDUCE_OPS)}")
    return getattr(dist.ReduceOp, name.upper())


def _all_reduce(tensor: "torch.Tensor", op: str, pg: "ProcessGroup") -> "torch.Tensor":
    import torch
    import torch.distributed as dist

    out = tensor.clone(memory_format=torch.contiguous_format)
    if op.lower() == "avg" and _detour(pg, tensor):
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=pg)
        return out.div_(pg.size())
    dist.all_reduce(out, op=_reduce_op(op), group=pg)
    return out


def _all_gather(tensor: "torch.Tensor", pg: "ProcessGroup") -> "torch.Tensor":
    import torch.distributed as dist

    size = pg.size()
    tensor = tensor.contiguous()
    out = tensor.new_empty((size * tensor.shape[0],) + tuple(tensor.shape[1:]))
    if _detour(pg, tensor):
        dist.all_gather(list(out.view((size,) + tuple(tensor.shape)).unbind(0)), tensor, group=pg)
    else:
        dist.all_gather_into_tensor(out, tensor, group=pg)
    return out


def _reduce_scatter(tensor: "torch.Tensor", op: str, pg: "ProcessGroup") -> "torch.Tensor":
    import torch.distributed as dist

    size, rank = pg.size(), dist.get_rank(pg)
    if tensor.shape[0] % size:
        raise ValueError(f"input dimension 0 ({tensor.shape[0]}) must be a multiple of group_size {size}")
    rows = tensor.shape[0] // size
    if _detour(pg, tensor):
        return _all_reduce(tensor, op, pg).narrow(0, rank * rows, rows).clone()
    out = tensor.new_empty((rows,) + tuple(tensor.shape[1:]))
    dist.reduce_scatter_tensor(out, tensor.contiguous(), op=_reduce_op(op), group=pg)
    return out


def _all_to_all(tensor: "torch.Tensor", output_split_sizes: List[int], input_split_sizes: List[int],
                pg: "ProcessGroup") -> "torch.Tensor":
    import torch.distributed as dist

    out = tensor.new_empty((sum(output_split_sizes),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes, input_split_sizes, group=pg)
    return out


def _broadcast(tensor: "torch.Tensor", src: int, pg: "ProcessGroup") -> "torch.Tensor":
    import torch
    import torch.distributed as dist

    out = tensor.clone(memory_format=torch.contiguous_format)
    dist.broadcast(out, src=dist.get_global_rank(pg, src), group=pg)  # src is a group rank, as in torch
    return out


# -- autograd ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _collective_function() -> type:
    import torch

    class Collective(torch.autograd.Function):
        """A collective ``forward(x)`` whose gradient is another collective ``backward(grad)``."""

        @staticmethod
        def forward(ctx: Any, x: "torch.Tensor", forward: Callable, backward: Callable) -> "torch.Tensor":
            ctx.backward_collective = backward
            return forward(x)

        @staticmethod
        def backward(ctx: Any, grad: "torch.Tensor") -> Tuple[Any, None, None]:
            return ctx.backward_collective(grad.contiguous()), None, None

    return Collective


def _apply(x: "torch.Tensor", forward: Callable, backward: Callable) -> "torch.Tensor":
    return _collective_function().apply(x, forward, backward)


def _sum_only(name: str, op: str, backward: Callable) -> Callable:
    """The backward for a reduction: defined for "sum" only, raising (lazily) as torch 2.13 does."""
    if op.lower() == "sum":
        return backward

    def unsupported(grad: "torch.Tensor") -> "torch.Tensor":
        raise RuntimeError(f"{name} backward only supports 'sum' reduction, got '{op.lower()}'")

    return unsupported


def _gather0(x: "torch.Tensor", pg: "ProcessGroup") -> "torch.Tensor":
    return _apply(x, lambda t: _all_gather(t, pg), lambda g: _reduce_scatter(g, "sum", pg))


def _scatter0(x: "torch.Tensor", op: str, pg: "ProcessGroup") -> "torch.Tensor":
    _reduce_op(op)
    return _apply(x, lambda t: _reduce_scatter(t, op, pg),
                  _sum_only("reduce_scatter_tensor", op, lambda g: _all_gather(g, pg)))


# -- the public functions (torch 2.13 signatures) ------------------------------------------------------------
def wait_tensor(tensor: "torch.Tensor") -> "torch.Tensor":
    """The collectives here finish before they return: nothing to wait for, ``tensor`` itself."""
    return tensor


def broadcast(self: "torch.Tensor", src: int, group: Any, tag: str = "") -> "torch.Tensor":
    """``self`` of group rank ``src``, on every rank of ``group``."""
    import torch
    import torch.distributed as dist

    pg = _process_group(group)

    def grad_to_source(grad: "torch.Tensor") -> "torch.Tensor":
        total = _all_reduce(grad, "sum", pg)
        return total if dist.get_rank(pg) == src else torch.zeros_like(total)

    return _apply(self, lambda t: _broadcast(t, src, pg), grad_to_source)


def all_reduce(self: "torch.Tensor", reduceOp: str, group: Any, tag: str = "") -> "torch.Tensor":
    """Reduce ``self`` over ``group`` with ``reduceOp`` ("sum", "avg", "max", ...); ``self`` is unchanged."""
    pg = _process_group(group)
    _reduce_op(reduceOp)
    return _apply(self, lambda t: _all_reduce(t, reduceOp, pg),
                  _sum_only("all_reduce", reduceOp, lambda g: _all_reduce(g, "sum", pg)))


def all_gather_tensor(self: "torch.Tensor", gather_dim: int, group: Any, tag: str = "") -> "torch.Tensor":
    """Every rank's ``self`` concatenated along ``gather_dim`` in group-rank order."""
    import torch

    pg = _process_group(group)
    out = _gather0(self.reshape(1) if self.dim() == 0 else self, pg)
    if gather_dim != 0:
        out = torch.cat(out.chunk(pg.size()), dim=gather_dim)
    return out


def reduce_scatter_tensor(self: "torch.Tensor", reduceOp: str, scatter_dim: int, group: Any,
                          tag: str = "") -> "torch.Tensor":
    """This rank's ``group_size``-th of ``self`` along ``scatter_dim``, reduced over ``group``."""
    import torch

    pg = _process_group(group)
    size = pg.size()
    if self.size(scatter_dim) % size:
        raise ValueError(f"input dimension {scatter_dim} ({self.size(scatter_dim)}) must be a multiple of group_size {size}")
    if scatter_dim != 0:
        self = torch.cat(self.chunk(size, dim=scatter_dim))
    return _scatter0(self, reduceOp, pg)


def all_to_all_single(self: "torch.Tensor", output_split_sizes: Optional[List[int]],
                      input_split_sizes: Optional[List[int]], group: Any, tag: str = "") -> "torch.Tensor":
    """Split ``self`` along dim 0 by ``input_split_sizes``, send split i to group rank i and concatenate
    what arrives (``output_split_sizes`` rows from each rank); ``None`` for both splits evenly."""
    pg = _process_group(group)
    if (output_split_sizes is None) != (input_split_sizes is None):
        raise ValueError("output_split_sizes and input_split_sizes must either be specified together or both set to None")
    if output_split_sizes is None or input_split_sizes is None:
        size = pg.size()
        if self.shape[0] % size:
            raise ValueError(f"input dimension 0 ({self.shape[0]}) must be a multiple of group_size {size}")
        output_split_sizes = input_split_sizes = [self.shape[0] // size] * size
    out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)
    return _apply(self, lambda t: _all_to_all(t, out_splits, in_splits, pg),
                  lambda g: _all_to_all(g, in_splits, out_splits, pg))


def permute_tensor(self: "torch.Tensor", src_dst: List[int], group: Any, tag: str = "") -> "torch.Tensor":
    """``src_dst[m] == n``: group rank m sends its ``self`` to group rank n (along dim 0)."""
    import torch.distributed as dist

    pg = _process_group(group)
    me, rows = dist.get_rank(pg), self.shape[0]
    output_split_sizes, input_split_sizes = [0] * pg.size(), [0] * pg.size()
    for src, dst in enumerate(src_dst):
        if src == me:
            input_split_sizes[dst] = rows
        if dst == me:
            output_split_sizes[src] = rows
    return all_to_all_single(self, output_split_sizes, input_split_sizes, pg)


def all_reduce_coalesced(self: List["torch.Tensor"], reduceOp: str, group: Any,
                         tag: str = "") -> List["torch.Tensor"]:
    """:func:`all_reduce` of each tensor."""
    return [all_reduce(t, reduceOp, group) for t in self]


def all_gather_into_tensor_coalesced(self: List["torch.Tensor"], group: Any,
                                     tag: str = "") -> List["torch.Tensor"]:
    """:func:`all_gather_tensor` of each tensor along dim 0."""
    return [all_gather_tensor(t, 0, group) for t in self]


def reduce_scatter_tensor_coalesced(inputs: List["torch.Tensor"], reduceOp: str, scatter_dim: List[int],
                                    group: Any, tag: str = "") -> List["torch.Tensor"]:
    """:func:`reduce_scatter_tensor` of each tensor along its ``scatter_dim``."""
    if len(scatter_dim) != len(inputs):
        raise ValueError(f"Length of scatter_dim ({len(scatter_dim)}) must equal length of inputs ({len(inputs)})")
    return [reduce_scatter_tensor(t, reduceOp, dim, group) for t, dim in zip(inputs, scatter_dim)]


FUNCTIONS: Dict[str, Callable[..., Any]] = {
    fn.__name__: fn
    for fn in (all_reduce, all_gather_tensor, reduce_scatter_tensor, all_to_all_single,
               all_gather_into_tensor_coalesced, reduce_scatter_tensor_coalesced, all_reduce_coalesced,
               wait_tensor, broadcast, permute_tensor)
}


# torch 2.13's names -> the names of the functions computing the same before (2.13's ``*_autograd`` call
# the plain function, differentiable from 2.13 on, and from 2.4 on with funcol-autograd)
RENAMED: Dict[str, str] = {
    "all_gather_single": "all_gather_tensor",
    "all_gather_single_autograd": "all_gather_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_single_autograd": "reduce_scatter_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
}


def _old_function(module: ModuleType, new: str) -> Callable[..., Any]:
    """``module``'s function computing what ``new`` computes in torch 2.13; for a ``*_autograd`` name on
    a torch without the ``*_autograd`` functions (before 2.4), whose own are not differentiable, this
    patch's."""
    old = RENAMED[new]
    if new.endswith("_autograd") and not hasattr(module, old + "_autograd"):
        return FUNCTIONS[old]
    return getattr(module, old)


def wait_tensors(tensors: List["torch.Tensor"]) -> List["torch.Tensor"]:
    """Wait on tensors returned by the same multi-output collective: each one's ``wait_tensor``."""
    import importlib

    wait_tensor = importlib.import_module(MODULE).wait_tensor
    return [wait_tensor(t) for t in tensors]


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch is built without torch.distributed")
    module.__doc__ = "torchpatch's synchronous functional collectives (torch 2.13 signatures)."
    module.__all__ = list(FUNCTIONS) + list(RENAMED) + ["wait_tensors"]
    for name, fn in FUNCTIONS.items():
        setattr(module, name, fn)
    for new in RENAMED:
        setattr(module, new, _old_function(module, new))
    module.wait_tensors = wait_tensors


def _serve(fn: Callable[..., Any]) -> Callable[[], Callable[..., Any]]:
    return lambda: fn


def _serve_renamed(new: str) -> Callable[[], Callable[..., Any]]:
    def factory() -> Callable[..., Any]:
        import importlib

        return _old_function(importlib.import_module(MODULE), new)

    return factory


for _name, _fn in FUNCTIONS.items():
    PATCH.symbol(MODULE, _name)(_serve(_fn))
for _new in RENAMED:
    PATCH.symbol(MODULE, _new)(_serve_renamed(_new))
PATCH.symbol(MODULE, "wait_tensors")(_serve(wait_tensors))

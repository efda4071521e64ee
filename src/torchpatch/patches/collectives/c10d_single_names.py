"""c10d-single-names: ``all_gather_single``, ``reduce_scatter_single`` (torch 2.4-2.12) and
``gather_single``, ``gather_into_tensor`` (torch 2.4-2.13) in ``torch.distributed``.

What breaks:   code written for torch 2.15, which deprecates ``all_gather_into_tensor`` and
               ``reduce_scatter_tensor`` in favour of their new names, dies on torch 2.12 and older
               with ``AttributeError: module 'torch.distributed' has no attribute
               'all_gather_single'`` (``reduce_scatter_single`` likewise); ``dist.gather_single(t,
               out, dst=0)`` dies the same way on torch 2.13 and older.
Torch:         2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to
               ``all_gather_single`` / ``reduce_scatter_single`` (same signatures; the old names are
               kept as aliases); 2.14 added ``gather_single(tensor, gather_tensor=None, dst=None,
               group=None, async_op=False, group_dst=None)`` and its alias ``gather_into_tensor``: a
               gather into one tensor on ``dst``, which gloo does not implement (2.14.1 and 2.15.0
               raise ``RuntimeError: Backend gloo does not support gather_single``) and NCCL does.
Fix:           served in ``torch.distributed.distributed_c10d`` and ``torch.distributed``:
               ``all_gather_single`` and ``reduce_scatter_single`` are this torch's very
               ``all_gather_into_tensor`` and ``reduce_scatter_tensor``. ``gather_single`` (and
               ``gather_into_tensor``, the same function) checks its arguments as 2.15 does (same
               errors: ``dst`` and ``group_dst`` both given, ``gather_tensor`` missing on the
               destination, dtypes differing), then on a group whose backend for the tensor's device
               is NCCL runs this torch's ``gather`` into views of ``gather_tensor`` (which must be
               contiguous and hold ``group size`` times ``tensor``'s elements, flat or stacked);
               other backends raise 2.15's ``RuntimeError: Backend <name> does not support
               gather_single``. ``async_op=True`` returns the gather's work.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py
               (``all_gather_single``, ``reduce_scatter_single``, ``gather_single``)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from torchpatch import Patch

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup, Work

C10D = "torch.distributed.distributed_c10d"
MODULES = (C10D, "torch.distributed")
RENAMED = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
GATHER_NAMES = ("gather_single", "gather_into_tensor")
GATHER_BACKENDS = ("nccl",)  # the backends of torch 2.15 that implement gather_single

PATCH = Patch(
    id="c10d-single-names",
    summary="torch.distributed.all_gather_single, reduce_scatter_single (2.4-2.12: this torch's "
    "all_gather_into_tensor, reduce_scatter_tensor), gather_single and gather_into_tensor (2.4-2.13)",
    torch=">=2.4,<2.14",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/distributed_c10d.py",
)


def gather_single(
    tensor: "torch.Tensor",
    gather_tensor: Optional["torch.Tensor"] = None,
    dst: Optional[int] = None,
    group: Optional["ProcessGroup"] = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
) -> Optional["Work"]:
    """Gather every rank's ``tensor`` into the one tensor ``gather_tensor`` on ``dst`` (a global rank;
    ``group_dst``: a rank in ``group``; neither: global rank 0). ``tensor`` has the same size on every
    rank; ``gather_tensor``, used on the destination only, holds them in group-rank order."""
    from torch.distributed import distributed_c10d as c10d

    c10d._check_single_tensor(tensor, "tensor")
    pg = c10d._get_default_group() if group is None or group is c10d.GroupMember.WORLD else group
    if c10d._rank_not_in_group(pg):
        c10d._warn_not_in_group("gather_single")
        return None
    if dst is not None and group_dst is not None:
        raise ValueError("Can't specify both group_rank and global_rank")
    if group_dst is None:
        group_dst = c10d.get_group_rank(pg, 0 if dst is None else dst)
    gather_list = None
    if group_dst == pg.rank():
        if gather_tensor is None:
            raise ValueError("gather_tensor must be specified on the destination rank")
        c10d._check_single_tensor(gather_tensor, "gather_tensor")
        c10d._ensure_all_tensors_same_dtype(tensor, gather_tensor)
    backend = pg._get_backend(tensor.device).name()
    if backend not in GATHER_BACKENDS:
        raise RuntimeError(f"Backend {backend} does not support gather_single")
    if gather_tensor is not None and group_dst == pg.rank():
        gather_list = list(_rank_views(gather_tensor, tensor, pg.size()))
    return c10d.gather(tensor, gather_list, dst=c10d.get_global_rank(pg, group_dst), group=pg, async_op=async_op)


def _rank_views(gather_tensor: "torch.Tensor", tensor: "torch.Tensor", size: int) -> Any:
    """``gather_tensor`` as ``size`` tensors shaped like ``tensor``, one per group rank."""
    if not gather_tensor.is_contiguous():
        raise RuntimeError("gather_single: gather_tensor must be contiguous")
    if gather_tensor.numel() != size * tensor.numel():
        raise RuntimeError(f"gather_single: gather_tensor must have {size} * {tensor.numel()} elements "
                           f"(the group's size times the input's), got {gather_tensor.numel()}")
    return gather_tensor.view((size,) + tuple(tensor.shape)).unbind(0)


def _renamed(old: str) -> Callable[[], Any]:
    def factory() -> Any:
        from torch.distributed import distributed_c10d

        return getattr(distributed_c10d, old)

    return factory


for _module in MODULES:
    for _new, _old in RENAMED.items():
        PATCH.symbol(_module, _new)(_renamed(_old))
    for _name in GATHER_NAMES:
        PATCH.symbol(_module, _name)(lambda: gather_single)

"""dtensor-partial: the ``Partial`` placement, taking a reduce-op name, where torch lacks it (2.1-2.3)
or its public name (2.4), torch 2.1-2.4.

What breaks:   torchtitan (mid 2024) and other code written for torch >= 2.4 does
               ``from torch.distributed._tensor import Partial`` and dies with
               ``ImportError: cannot import name 'Partial' from 'torch.distributed._tensor'``.
               torch 2.1–2.3 only have ``placement_types._Partial``, which takes a
               ``c10d.ReduceOp`` enum (``_Partial(ReduceOp.MAX)``), not ``Partial("max")``.
Torch:         2.1–2.3 lack ``Partial``; 2.4 has it in ``torch.distributed._tensor`` but, like
               2.1–2.3, not in the public ``torch.distributed.tensor`` (2.5 and later have both).
Fix:           serve ``Partial`` in ``torch.distributed._tensor`` and its ``placement_types`` where
               missing: a subclass of torch's own ``_Partial``, so every check torch makes
               (``is_partial()``, ``isinstance(p, _Partial)``, equality, hashing in the sharding
               caches) treats it as the partial placement it is. ``Partial()``, ``Partial("sum")``,
               ``Partial(reduce_op="max")`` take the names torch >= 2.4 documents: "sum", "avg",
               "product", "min", "max" (any case, or the ``ReduceOp`` enum); anything else is a
               ``ValueError`` naming those. As on 2.1's ``_Partial``, ``reduce_op`` holds the
               ``ReduceOp`` enum (torch 2.1 reads ``reduce_op.name``); ``repr`` is ``Partial(max)``
               as on torch >= 2.4, and a pickled ``Partial`` loads as torch's own ``Partial`` on
               torch >= 2.4. Redistributing to ``Replicate`` all-reduces, to ``Shard(d)``
               reduce-scatters; "avg" is a sum followed by a division by the mesh dimension's
               size, because gloo cannot average (2.1 and 2.4 raise; 2.9 and 2.13 average on gloo too).
               ``isinstance(p, Partial)`` also holds for the ``_Partial`` placements torch's own
               ops create (``dt.sum()`` of a sharded DTensor), as on torch >= 2.4 where
               ``_Partial`` is ``Partial``. ``torch.distributed.tensor.Partial`` (2.1–2.4) is served
               as the very ``torch.distributed._tensor.Partial``; that is why this patch requires
               dtensor-public, which serves the rest of that namespace.
Upstream:      https://github.com/pytorch/pytorch/pull/127420 (``_Partial`` renamed ``Partial``,
               torch 2.4); the torchtitan report: https://github.com/pytorch/torchtitan/issues/412
"""

import functools
from typing import Any

from torchpatch import Patch

PATCH = Patch(
    id="dtensor-partial",
    summary="Partial placement taking a reduce-op name (Partial('sum'), Partial(reduce_op='max')) for DTensor",
    torch=">=2.1,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/127420",
    requires=("dtensor-public",),
)

REDUCE_OPS = ("sum", "avg", "product", "min", "max")


@functools.lru_cache(maxsize=None)
def partial_class() -> type:
    """The one ``Partial`` class served everywhere (built on first use: it needs torch)."""
    import torch
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed._tensor.placement_types import _Partial

    red_op_type = c10d.ReduceOp.RedOpType
    by_name = {name: getattr(red_op_type, name.upper()) for name in REDUCE_OPS}
    avg, total = by_name["avg"], by_name["sum"]

    def to_enum(reduce_op: Any) -> Any:
        if isinstance(reduce_op, red_op_type) and reduce_op in by_name.values():
            return reduce_op
        if isinstance(reduce_op, str) and reduce_op.lower() in by_name:
            return by_name[reduce_op.lower()]
        raise ValueError(
            f"Partial(reduce_op={reduce_op!r}): on torch {torch.__version__} (served by torchpatch) "
            f"the reduce ops are {', '.join(repr(n) for n in REDUCE_OPS)}"
        )

    class PartialMeta(type):
        """Makes torch's own ``_Partial`` placements instances of ``Partial`` (2.4: one class)."""

        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, _Partial) if cls is Partial else type.__instancecheck__(cls, obj)

        def __subclasscheck__(cls, sub: type) -> bool:
            return issubclass(sub, _Partial) if cls is Partial else type.__subclasscheck__(cls, sub)

    class Partial(_Partial, metaclass=PartialMeta):
        """A DTensor placement pending a reduction over a mesh dimension (torch >= 2.4's
        ``Partial``), on torch's ``_Partial``."""

        def __init__(self, reduce_op: Any = "sum") -> None:
            super().__init__(to_enum(reduce_op))

        def _to_replicate(self, tensor: torch.Tensor, mesh: Any, mesh_dim: int) -> torch.Tensor:
            if self.reduce_op != avg:
                return super()._to_replicate(tensor, mesh, mesh_dim)
            summed = funcol.all_reduce(tensor, reduceOp=total.name, group=(mesh, mesh_dim))
            return summed.div_(mesh.size(mesh_dim))

        def _to_shard(self, tensor: torch.Tensor, mesh: Any, mesh_dim: int, shard_spec: Any) -> torch.Tensor:
            if self.reduce_op != avg:
                return super()._to_shard(tensor, mesh, mesh_dim, shard_spec)
            summed = shard_spec._reduce_shard_tensor(tensor, mesh, total, mesh_dim)
            return summed.div_(mesh.size(mesh_dim))

        def __reduce__(self) -> Any:
            return (Partial, (self.reduce_op.name.lower(),))

        def __repr__(self) -> str:
            return f"Partial({self.reduce_op.name.lower()})"

    # Where torch >= 2.4 keeps it: pickles name this path, which loads torch's own Partial there.
    Partial.__module__, Partial.__qualname__ = "torch.distributed._tensor.placement_types", "Partial"
    return Partial


@PATCH.symbol("torch.distributed._tensor.placement_types", "Partial")
@PATCH.symbol("torch.distributed._tensor", "Partial")
def serve_partial() -> type:
    return partial_class()


@PATCH.symbol("torch.distributed.tensor", "Partial")
def serve_public_partial() -> type:
    import torch.distributed._tensor as dtensor  # its Partial: torch's own on 2.4, the one above before

    return dtensor.Partial

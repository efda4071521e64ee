"""fsdp-data-parallel-mesh-dims: ``torch.distributed.fsdp.DataParallelMeshDims`` (the value class) on
torch 2.4-2.11.

What breaks:   torchtitan 0.3.0 imports it at module level in the FSDP module every model's
               ``parallelize`` imports, so on torch 2.11 and older nothing trains, FSDP or not:
               ``ImportError: cannot import name 'DataParallelMeshDims' from 'torch.distributed.fsdp'``.
Torch:         2.12 added the dataclass (which dimensions of a full SPMD mesh FSDP shards and replicates
               over) with ``fully_shard``'s ``dp_mesh_dims`` argument; 2.4-2.11 have neither.
Fix:           serve the class with 2.15's fields, validation (``ValueError`` when neither ``shard`` nor
               ``replicate`` is set) and ``shard_names``/``replicate_names``. Only the class:
               ``fully_shard(dp_mesh_dims=...)`` is fsdp2-dp-mesh-dims' (FSDP/HSDP, with TP too; the
               shapes it cannot take: not_backportable.json). The class is also
               ``torch.distributed.fsdp._fully_shard.DataParallelMeshDims`` where that package exists.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.12.1/torch/distributed/fsdp/_fully_shard/_fsdp_api.py
"""

from dataclasses import dataclass
from typing import Optional, Tuple, Union

from torchpatch import Patch
from torchpatch.patches._reexport import reexport

PATCH = Patch(
    id="fsdp-data-parallel-mesh-dims",
    summary="torch.distributed.fsdp.DataParallelMeshDims, the value class (fully_shard's dp_mesh_dims: "
    "fsdp2-dp-mesh-dims)",
    torch=">=2.4,<2.12",
    upstream="https://github.com/pytorch/pytorch/tree/v2.12.1/torch/distributed/fsdp/_fully_shard/_fsdp_api.py",
)

_Names = Optional[Union[str, Tuple[str, ...]]]


def _as_names(names: _Names) -> Tuple[str, ...]:
    if names is None:
        return ()
    return (names,) if isinstance(names, str) else tuple(names)


@dataclass
class DataParallelMeshDims:
    """The mesh dimension name(s) FSDP shards parameters on (``shard``) and replicates them over
    (``replicate``, HSDP/DDP) within a full SPMD mesh; several names are flattened into one dim."""

    shard: _Names = None
    replicate: _Names = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> Tuple[str, ...]:
        return _as_names(self.shard)

    @property
    def replicate_names(self) -> Tuple[str, ...]:
        return _as_names(self.replicate)


@PATCH.symbol("torch.distributed.fsdp", "DataParallelMeshDims")
def _data_parallel_mesh_dims() -> type:
    DataParallelMeshDims.__module__ = "torch.distributed.fsdp"
    return DataParallelMeshDims


# where torch 2.15 defines it too (fully_shard's package, 2.9-2.11 here): the same class
PATCH.symbol("torch.distributed.fsdp._fully_shard", "DataParallelMeshDims")(
    reexport("torch.distributed.fsdp", "DataParallelMeshDims"))

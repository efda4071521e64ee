"""dtensor-spec-module: ``torch.distributed.tensor._dtensor_spec`` on torch 2.2-2.4, and
``_StridedShard`` importable there.

What breaks:   code written for torch >= 2.5 that works with DTensor internals (torchtitan's
               SimpleFSDP, imported by ``import torchtitan`` itself in 0.1.0) does
               ``from torch.distributed.tensor._dtensor_spec import DTensorSpec`` and
               ``from torch.distributed.tensor.placement_types import _StridedShard``:
               ``ModuleNotFoundError: No module named 'torch.distributed.tensor._dtensor_spec'``.
Torch:         2.2-2.4 define ``DTensorSpec`` and ``TensorMeta`` in ``placement_types``; 2.5 moved
               them into ``_dtensor_spec`` when DTensor moved to ``torch.distributed.tensor``, and
               added the ``_StridedShard`` placement (FSDP2 + TP sharding of one tensor dimension).
               2.1 has no ``TensorMeta`` (its spec holds torch.fx's ``TensorMetadata``): not served there.
Fix:           serve the module ``torch.distributed.tensor._dtensor_spec`` holding the very
               ``DTensorSpec`` and ``TensorMeta`` of ``torch.distributed._tensor.placement_types``.
               ``_StridedShard`` is not served as a working placement: 2.4's sharding propagation,
               redistribution and FSDP2 do not know it and would compute wrong layouts. The
               name is served (so modules that import it load) as a class whose construction
               raises ``NotImplementedError`` saying so; ``isinstance(p, _StridedShard)`` is False
               for every placement 2.2-2.4 make, which is true there.
Upstream:      https://github.com/pytorch/pytorch/pull/126697 (``_StridedShard``, torch 2.5)
"""

from types import ModuleType
from typing import Any

from torchpatch import Patch
from torchpatch.patches._reexport import reexport

PATCH = Patch(
    id="dtensor-spec-module",
    summary="torch.distributed.tensor._dtensor_spec (DTensorSpec, TensorMeta) on torch 2.2-2.4; "
    "_StridedShard importable (not constructible)",
    torch=">=2.2,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/126697",
)
PATCH.sets("torch.distributed.tensor._dtensor_spec", ("DTensorSpec", "TensorMeta"))
for _name in ("DTensorSpec", "TensorMeta"):  # torch 2.15's torch.distributed.tensor re-exports them, private
    PATCH.symbol("torch.distributed.tensor", f"_{_name}")(reexport("torch.distributed.tensor._dtensor_spec", _name))


@PATCH.module("torch.distributed.tensor._dtensor_spec")
def build(module: ModuleType) -> None:
    from torch.distributed._tensor import placement_types

    module.DTensorSpec = placement_types.DTensorSpec
    module.TensorMeta = placement_types.TensorMeta
    module.__all__ = ["DTensorSpec", "TensorMeta"]


def _strided_shard() -> Any:
    import torch
    from torch.distributed._tensor.placement_types import Shard

    class _StridedShard(Shard):
        """FSDP2 + TP strided sharding (torch >= 2.5): not constructible on this torch."""

        def __init__(self, dim: int, split_factor: int = 1) -> None:
            raise NotImplementedError(
                f"_StridedShard needs torch >= 2.5: torch {torch.__version__}'s DTensor sharding propagation, "
                f"redistribution and FSDP2 do not know it (torchpatch serves the name only so that modules "
                f"importing it load)"
            )

    _StridedShard.__module__ = "torch.distributed._tensor.placement_types"
    return _StridedShard


PATCH.symbol("torch.distributed._tensor.placement_types", "_StridedShard")(_strided_shard)
# torch 2.15's torch.distributed.tensor re-exports it (2.4's own, 2.2-2.3's served one above)
PATCH.symbol("torch.distributed.tensor", "_StridedShard")(reexport("torch.distributed._tensor.placement_types", "_StridedShard"))

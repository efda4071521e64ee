"""dcp-metadata-strides: read the ``TensorProperties`` of torch 2.15's checkpoints (their sixth field,
``strides``), torch 2.3-2.14.

What breaks:   ``dcp.load`` of a checkpoint that torch 2.15 saved fails before reading any tensor:
               2.15 pickles each tensor's ``TensorProperties`` in ``.metadata`` with a sixth field,
               the saved tensor's ``strides``, and the older ``TensorProperties.__setstate__``
               unpacks five: ``ValueError: too many values to unpack (expected 5)`` on one process
               (torch 2.4); inside ``dcp.load`` the coordinator's metadata read fails and every rank
               raises: ``AssertionError: metadata is None; global metadata read failed: too many
               values to unpack (expected 5)`` (torch 2.13, 2.14), a bare ``AssertionError`` (2.9) or
               ``CheckpointException ranks:dict_keys([0, 1])`` (2.4, 2.9 on 2 ranks; torchtitan's
               resume).
Torch:         2.3 (where ``torch.distributed.checkpoint.metadata`` got its own ``TensorProperties``
               and ``_MEM_FORMAT_ENCODING``, which 2.15's pickle names) to 2.14; 2.15 reads both
               layouts. Torch 2.2 and older cannot read checkpoints of 2.3 and newer in the first
               place (no ``checkpoint.metadata._MEM_FORMAT_ENCODING``): not served there.
Fix:           ``TensorProperties.__setstate__`` (``checkpoint.metadata``'s and
               ``_shard.sharded_tensor.metadata``'s, which 2.15 changed alike) takes the six-field
               state as 2.15 does: the first five as before, the sixth kept as ``strides``; a
               five-field state gives ``strides = None``, the class's default. Nothing else in a 2.15
               checkpoint differs: 2.15's loaders never read ``strides`` (it only records the
               layout of the saved tensor; the data files hold each tensor as ``torch.save``
               wrote it, and the load copies it into the caller's tensor, whatever its strides), so
               every tensor loads with the values 2.15 saved. ``__getstate__`` is left alone: this
               torch's own checkpoints keep the five-field layout that every torch reads.
Upstream:      https://github.com/pytorch/pytorch/pull/194251 (strides in ``TensorProperties``;
               first as https://github.com/pytorch/pytorch/pull/175011)
"""

from __future__ import annotations

from dataclasses import fields
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-metadata-strides",
    summary="dcp.load reads torch 2.15's checkpoints, whose TensorProperties carry a sixth field (strides)",
    torch=">=2.3,<2.15",
    upstream="https://github.com/pytorch/pytorch/pull/194251",
    behaviour="unpickling torch 2.15's TensorProperties (dcp.load of a checkpoint saved by torch 2.15)",
)

MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed._shard.sharded_tensor.metadata")
for _module in MODULES:
    PATCH.sets(_module + ".TensorProperties", ("strides",))

_FIELDS = 5  # dtype, layout, requires_grad, memory-format encoding, pin_memory: the state torch < 2.15 pickles


def _setstate_with_strides(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    state = args[0] if args else kwargs["state"]
    strides = None
    if len(state) == _FIELDS + 1:
        state, strides = tuple(state[:_FIELDS]), state[_FIELDS]
    wrapped(state)  # any other length fails as it does in torch itself
    instance.strides = strides


def _serve_strides(patcher: Patcher, metadata: ModuleType) -> bool:
    properties = getattr(metadata, "TensorProperties", None)
    if properties is None or "strides" in {f.name for f in fields(properties)}:
        return False  # torch >= 2.15 has the field
    if "strides" in vars(properties):
        return False  # served already: the other module's TensorProperties is this very class
    patcher.setattr(properties, "strides", None)
    patcher.wrap(properties, "__setstate__", _setstate_with_strides)
    return True


for _module in MODULES:
    PATCH.on_import(_module)(_serve_strides)

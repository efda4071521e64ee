"""``torch.distributed.checkpoint.protocol`` as torch 2.14 defines it: the ``CheckpointableTensor``
Protocol and the helpers DCP's planner uses to save and load such a tensor as global-tensor shards.

Imported only once ``torch.distributed.checkpoint`` is (its ``metadata`` module is needed here).
"""

from __future__ import annotations

from typing import List, Protocol, Tuple, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

MODULE = "torch.distributed.checkpoint.protocol"
_NOT_A_TENSOR = "CheckpointableTensor must also be a torch.Tensor"


@runtime_checkable
class CheckpointableTensor(Protocol):
    """Fields that make DCP checkpoint a plain local tensor as shards of a global tensor.

    ``global_shape``: the global tensor's shape; ``global_offsets``: each local shard's start in the
    global tensor; ``local_offsets``: each shard's start inside the local tensor (several shards in
    one tensor, padding); ``local_sizes``: each shard's shape.
    """

    global_shape: Tuple[int, ...]
    global_offsets: Tuple[Tuple[int, ...], ...]
    local_offsets: Tuple[Tuple[int, ...], ...]
    local_sizes: Tuple[Tuple[int, ...], ...]


CheckpointableTensor.__module__ = MODULE


def _is_checkpointable_tensor(obj: object) -> bool:
    return isinstance(obj, torch.Tensor) and isinstance(obj, CheckpointableTensor)


def _copy_checkpointable_tensor_metadata(src: CheckpointableTensor, dst: torch.Tensor) -> None:
    for name in ("global_shape", "global_offsets", "local_offsets", "local_sizes"):
        setattr(dst, name, getattr(src, name))


def _validate_checkpointable_tensor_metadata(tensor: CheckpointableTensor) -> None:
    """Raise torch 2.14's ``ValueError`` where the fields do not describe shards of both the
    global tensor and the local one."""
    count = len(tensor.global_offsets)
    if len(tensor.local_offsets) != count:
        raise ValueError("global_offsets and local_offsets must have the same length")
    if len(tensor.local_sizes) != count:
        raise ValueError("global_offsets and local_sizes must have the same length")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(_NOT_A_TENSOR)
    global_shape, local_shape = tensor.global_shape, tuple(tensor.size())
    shards = zip(tensor.global_offsets, tensor.local_offsets, tensor.local_sizes)
    for idx, (global_offset, local_offset, size) in enumerate(shards):
        if len(global_offset) != len(global_shape):
            raise ValueError(f"global_offsets[{idx}] must have {len(global_shape)} dimensions")
        if len(local_offset) != len(local_shape):
            raise ValueError(f"local_offsets[{idx}] must have {len(local_shape)} dimensions")
        if len(size) != len(global_shape):
            raise ValueError(f"local_sizes[{idx}] must have {len(global_shape)} dimensions")
        if len(size) != len(local_shape):
            raise ValueError(f"local_sizes[{idx}] must have {len(local_shape)} local dimensions")
        for where, offsets, bounds in (("global", global_offset, global_shape),
                                       ("local", local_offset, local_shape)):
            for dim, (offset, length, bound) in enumerate(zip(offsets, size, bounds)):
                if offset < 0 or length < 0 or offset + length > bound:
                    outside = "global_shape" if where == "global" else "tensor shape"
                    raise ValueError(f"{where} shard {idx} dimension {dim} is outside {outside}")


def _get_checkpointable_tensor_chunks(tensor: CheckpointableTensor) -> List[ChunkStorageMetadata]:
    _validate_checkpointable_tensor_metadata(tensor)
    return [ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(size))
            for offset, size in zip(tensor.global_offsets, tensor.local_sizes)]


def _shard_position(tensor: CheckpointableTensor, index: MetadataIndex) -> int:
    """Which of the tensor's shards ``index`` names: by its hint, else by its global offset."""
    offsets = tensor.global_offsets
    if index.offset is None:
        if len(offsets) == 1:
            return 0
        raise ValueError(f"Cannot lookup {index.fqn} with multiple checkpointable shards and no offset")
    if index.index is not None and index.index < len(offsets) and torch.Size(offsets[index.index]) == index.offset:
        return index.index
    for position, offset in enumerate(offsets):
        if torch.Size(offset) == index.offset:
            return position
    raise ValueError(f"Could not find checkpointable tensor shard at '{index.offset}' for FQN: '{index.fqn}'")


def _get_checkpointable_tensor_shard(tensor: CheckpointableTensor, index: MetadataIndex) -> torch.Tensor:
    """The view of the local tensor that holds the shard ``index`` names."""
    _validate_checkpointable_tensor_metadata(tensor)
    position = _shard_position(tensor, index)
    local_offset, size = tensor.local_offsets[position], tensor.local_sizes[position]
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(_NOT_A_TENSOR)
    if not local_offset:
        return tensor
    return tensor[tuple(slice(offset, offset + length) for offset, length in zip(local_offset, size))]


def write_items(fqn: str, tensor: CheckpointableTensor) -> List[WriteItem]:
    """One ``SHARD`` write item per shard, each sized as the global tensor (2.14's
    ``planner_helpers._get_checkpointable_tensor_write_items``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(_NOT_A_TENSOR)
    properties = TensorProperties.create_from_tensor(tensor)
    size = torch.Size(tensor.global_shape)
    return [WriteItem(index=MetadataIndex(fqn, chunk.offsets, idx), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=size))
            for idx, chunk in enumerate(_get_checkpointable_tensor_chunks(tensor))]

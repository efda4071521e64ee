"""dcp-serialization-format: ``torch.distributed.checkpoint.filesystem.SerializationFormat`` and
``FileSystemWriter(..., serialization_format=SerializationFormat.TORCH_SAVE)`` on torch 2.4-2.7.

What breaks:   code written for torch >= 2.8 that names the format of a file-system checkpoint
               (``from torch.distributed.checkpoint.filesystem import SerializationFormat``;
               ``FileSystemWriter(path, serialization_format=SerializationFormat.TORCH_SAVE)``) dies
               with ``ImportError: cannot import name 'SerializationFormat'`` or ``TypeError:
               FileSystemWriter.__init__() got an unexpected keyword argument
               'serialization_format'``.
Torch:         2.8 added the enum (``TORCH_SAVE``, ``SAFETENSORS``) and the argument; 2.4-2.7 write
               every file-system checkpoint with ``torch.save``.
Fix:           serve the enum, and let ``FileSystemWriter`` take ``serialization_format``:
               ``TORCH_SAVE`` writes what it always wrote, the same files as 2.8+; ``SAFETENSORS``
               raises ``NotImplementedError`` (the writer's per-file safetensors path is 2.8's
               ``filesystem`` write loop; ``hf_storage.HuggingFaceStorageWriter``, served by
               dcp-hf-storage, writes safetensors checkpoints on this torch). The module's format
               constants of torch 2.15 (``CURRENT_DCP_VERSION``, ``HF_DCP_VERSION``, the metadata keys)
               are served with 2.15's values.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.8.0/torch/distributed/checkpoint/filesystem.py
               (``SerializationFormat``, torch 2.8)
"""

from __future__ import annotations

import inspect
from enum import Enum
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-serialization-format",
    summary="torch.distributed.checkpoint.filesystem.SerializationFormat; FileSystemWriter(serialization_format=TORCH_SAVE)",
    torch=">=2.4,<2.8",
    upstream="https://github.com/pytorch/pytorch/blob/v2.8.0/torch/distributed/checkpoint/filesystem.py",
)

MODULE = "torch.distributed.checkpoint.filesystem"


class SerializationFormat(Enum):
    """How a ``FileSystemWriter`` serializes tensors."""

    TORCH_SAVE = "torch_save"
    SAFETENSORS = "safetensors"


SerializationFormat.__module__ = MODULE


def _take_serialization_format(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    fmt = kwargs.pop("serialization_format", SerializationFormat.TORCH_SAVE)
    if getattr(fmt, "value", fmt) != SerializationFormat.TORCH_SAVE.value:
        raise NotImplementedError(
            f"FileSystemWriter(serialization_format={fmt}) needs torch >= 2.8 (its safetensors write path); "
            "on this torch, torch.distributed.checkpoint.hf_storage.HuggingFaceStorageWriter writes safetensors")
    wrapped(*args, **kwargs)


PATCH.symbol(MODULE, "SerializationFormat")(lambda: SerializationFormat)

# torch 2.15's constants of the module (the DCP format version; the safetensors metadata keys it imports)
CONSTANTS: Dict[str, Any] = {"CURRENT_DCP_VERSION": "1.0.0", "HF_DCP_VERSION": 1.0, "DCP_VERSION_KEY": "DCP_VERSION",
                             "CUSTOM_METADATA_KEY": "DCP_SHARDING_INFO", "FORMAT_KEY": "format", "FORMAT_VALUE": "pt"}
for _name, _value in CONSTANTS.items():
    PATCH.symbol(MODULE, _name)(lambda _value=_value: _value)


@PATCH.on_import(MODULE)
def writer_takes_serialization_format(patcher: Patcher, filesystem: Any) -> bool:
    writer = filesystem.FileSystemWriter
    if "serialization_format" in inspect.signature(writer.__init__).parameters:
        return False
    patcher.wrap(writer, "__init__", _take_serialization_format)
    return True

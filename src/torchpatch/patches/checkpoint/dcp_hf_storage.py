"""dcp-hf-storage: ``torch.distributed.checkpoint.hf_storage`` (``HuggingFaceStorageWriter``,
``HuggingFaceStorageReader``), also exported from ``torch.distributed.checkpoint``, on torch 2.4-2.7.

What breaks:   saving or loading Hugging Face safetensors checkpoints through DCP as written for
               torch >= 2.9 (torchtitan's ``to_hf`` export: ``from torch.distributed.checkpoint import
               HuggingFaceStorageWriter``; ``dcp.save(state, storage_writer=HuggingFaceStorageWriter(path,
               fqn_to_index_mapping=...))``, ``dcp.load(state,
               storage_reader=HuggingFaceStorageReader(path))``) dies with ``ModuleNotFoundError: No
               module named 'torch.distributed.checkpoint.hf_storage'``.
Torch:         2.8 brought ``hf_storage`` (with another, hub-based signature), 2.9 the one 2.15
               has; 2.4-2.7 lack it. Torch 2.8's own classes are left as they are.
Fix:           serve the module with both classes, written here on the installed
               ``FileSystemWriter``/``FileSystemReader`` (``_hf_safetensors``), with 2.9+'s
               signatures and files: the writer puts each rank's tensors in
               ``model-0000i-of-0000N.safetensors`` files (``fqn_to_index_mapping``), with each chunk's
               ``saved_offsets`` in the safetensors metadata, and ``model.safetensors.index.json``;
               with ``save_distributed`` each rank writes ``shard-...`` files and
               ``enable_consolidation`` assembles the full tensors (in memory, on the coordinator)
               into the model files and index. The reader plans loads from the safetensors
               headers, slices included. Files are read and written by torch 2.15's own classes
               alike. Tensors only: a non-tensor value raises ``ValueError`` (2.15 writes its bytes
               into the safetensors file, which then cannot be read). Needs the ``safetensors``
               package, as torch's classes do.
Upstream:      https://github.com/pytorch/pytorch/pull/154518 (HF storage reader; the writer's 2.9
               signature: save_distributed, enable_consolidation)
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

from torchpatch import Patch

from ._hf_safetensors import MODULE, SHARDED_DIR, SHARDING_INFO, SUFFIX, make_classes

PATCH = Patch(
    id="dcp-hf-storage",
    summary="torch.distributed.checkpoint.hf_storage: HuggingFaceStorageWriter/Reader (safetensors) with 2.9+'s API",
    torch=">=2.4,<2.8",
    upstream="https://github.com/pytorch/pytorch/pull/154518",
)

NAMES = ("HuggingFaceStorageReader", "HuggingFaceStorageWriter")
# torch 2.15's module-level constants of the format (the keys and names the classes below write)
CONSTANTS = {"CUSTOM_METADATA_KEY": SHARDING_INFO, "SAVED_OFFSETS_KEY": "saved_offsets",
             "SHARDED_DIR_NAME": SHARDED_DIR, "SUFFIX": SUFFIX}
PATCH.sets(MODULE, NAMES + tuple(CONSTANTS))


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    module.HuggingFaceStorageReader, module.HuggingFaceStorageWriter = make_classes()
    for name, value in CONSTANTS.items():
        setattr(module, name, value)
    module.__all__ = list(NAMES)


def _from_module(name: str) -> Callable[[], Any]:
    def factory() -> Any:
        return getattr(importlib.import_module(MODULE), name)

    return factory


for _name in NAMES:
    PATCH.symbol("torch.distributed.checkpoint", _name)(_from_module(_name))

"""dcp-consolidate-hf-safetensors: ``torch.distributed.checkpoint._consolidate_hf_safetensors``
(``consolidate_safetensors_files``, ``consolidate_safetensors_files_on_every_rank``) on torch 2.4-2.7.

What breaks:   torchtitan 0.2.2 imports ``consolidate_safetensors_files_on_every_rank`` at module level in
               ``torchtitan/components/checkpoint.py``, which its trainer imports, so on torch 2.4 nothing
               trains, checkpointing or not: ``ModuleNotFoundError: No module named
               'torch.distributed.checkpoint._consolidate_hf_safetensors'``. torchtitan calls it to turn
               a distributed Hugging Face save (``last_save_in_hf``) into full model files.
Torch:         the module came with torch 2.9's ``hf_storage`` (the 2.15 API); 2.4-2.7 lack both (the
               storage classes are served by dcp-hf-storage, whose shard files these functions read).
Fix:           serve the module with both functions, 2.15's signatures and files: the full tensors of
               the shard files in ``input_dir`` (each chunk placed by its ``saved_offsets``) are assembled
               in memory and written to ``output_dir`` as ``model-0000i-of-0000N.safetensors``, one
               file per index of ``fqn_to_index_mapping``, with ``model.safetensors.index.json``. On
               every rank: rank ``r`` writes the files whose index ``% world_size == r`` (of
               ``process_group``, default the world), rank 0 the index of them all, then a barrier, as
               2.15 (one process without a process group: every file, no index, as 2.15). ``num_threads`` is accepted and not used (one thread). Needs ``safetensors``.
               The module's safetensors key constants are served with torch 2.15's values.
Upstream:      https://github.com/pytorch/pytorch/blob/v2.15.0/torch/distributed/checkpoint/_consolidate_hf_safetensors.py
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

from torchpatch import Patch

from ._hf_safetensors import consolidate_files, write_index

PATCH = Patch(
    id="dcp-consolidate-hf-safetensors",
    summary="torch.distributed.checkpoint._consolidate_hf_safetensors: consolidate_safetensors_files "
    "(and _on_every_rank), what torchtitan 0.2.2 imports at module level",
    torch=">=2.4,<2.8",
    upstream="https://github.com/pytorch/pytorch/blob/v2.15.0/torch/distributed/checkpoint/_consolidate_hf_safetensors.py",
    requires=("dcp-hf-storage",),
)

MODULE = "torch.distributed.checkpoint._consolidate_hf_safetensors"
NAMES = ("consolidate_safetensors_files", "consolidate_safetensors_files_on_every_rank")
# torch 2.15's constants of the module (imported there from checkpoint._hf_utils)
CONSTANTS = {"SUFFIX": ".safetensors", "DATA_OFFSETS_KEY": "data_offsets", "DEFAULT_EXTRA_METADATA_KEY": "__metadata__",
             "DTYPE_KEY": "dtype", "SAVED_OFFSETS_KEY": "saved_offsets", "SHAPE_KEY": "shape"}
PATCH.sets(MODULE, NAMES + tuple(CONSTANTS))


def consolidate_safetensors_files(input_dir: str, output_dir: str, fqn_to_index_mapping: Dict[str, int],
                                  num_threads: int = 1) -> None:
    """The shard files of ``input_dir`` as full model files and their index in ``output_dir``."""
    write_index(output_dir, consolidate_files(input_dir, output_dir, fqn_to_index_mapping))


def consolidate_safetensors_files_on_every_rank(input_dir: str, output_dir: str,
                                                fqn_to_index_mapping: Dict[str, int], num_threads: int = 1,
                                                process_group: Optional[Any] = None) -> None:
    """Each rank writes the model files whose index ``% world_size`` is its rank; rank 0 the index."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group=process_group) if distributed else 0
    world = dist.get_world_size(group=process_group) if distributed else 1
    mine = {fqn: index for fqn, index in fqn_to_index_mapping.items() if index % world == rank}
    written = (consolidate_files(input_dir, output_dir, mine, max(fqn_to_index_mapping.values()))
               if mine else {})
    if not distributed:  # as 2.15: the index is written only by rank 0 of a process group
        return
    gathered: Optional[List[Dict[str, Tuple[str, int]]]] = [{} for _ in range(world)] if rank == 0 else None
    dst = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.gather_object(written, gathered, dst=dst, group=process_group)
    if gathered is not None:
        write_index(output_dir, {fqn: entry for part in gathered for fqn, entry in part.items()})
    dist.barrier(group=process_group)


@PATCH.module(MODULE)
def build(module: ModuleType) -> None:
    module.consolidate_safetensors_files = consolidate_safetensors_files
    module.consolidate_safetensors_files_on_every_rank = consolidate_safetensors_files_on_every_rank
    for name, value in CONSTANTS.items():
        setattr(module, name, value)

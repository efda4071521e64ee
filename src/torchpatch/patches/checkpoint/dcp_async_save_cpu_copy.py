"""dcp-async-save-cpu-copy: ``dcp.async_save`` stages a copy of CPU tensors, torch 2.3-2.6.

What breaks:   ``torch.distributed.checkpoint.async_save`` is meant to return once the state dict is
               staged (copied to CPU memory), so training can go on while the checkpoint is written.
               For tensors that are already on the CPU (CPU/gloo training, CPU-offloaded optimizer
               state, FSDP1 ``ShardedTensor`` or DTensor shards on CPU) the "staged" state dict holds
               the very same tensors: an optimizer step taken before the background save reaches
               them writes the *new* values into the checkpoint, silently, with no error; a resumed
               run loads weights from a later step than the checkpoint claims (a torn checkpoint).
Torch:         2.3 (``async_save``) through 2.6: both the default writer's staging
               (``BlockingAsyncStager.stage`` without ``cache_staged_state_dict``) and
               ``async_save``'s own staging for writers that are not ``AsyncStager`` use
               ``_offload_state_dict_to_cpu``, whose ``tensor.to("cpu")`` returns a CPU tensor
               itself (pytorch#144657). Torch 2.7 stages into new CPU tensors
               (``_create_cpu_state_dict`` + ``_copy_state_dict``); read in 2.4.1's and 2.9.0's
               ``staging.py`` / ``state_dict_saver.py``.
Fix:           in ``torch.distributed.checkpoint.staging`` and ``state_dict_saver`` only, the
               offload that staging calls keeps torch's result but replaces every tensor of it
               that is the caller's own tensor (a CPU tensor, a CPU DTensor or ShardedTensor) by a
               clone made at once, on the calling thread; tensors it moved from a GPU are new
               already and stay as they are. Applied only where staging a CPU tensor hands back the
               same tensor (checked by staging one), and only where ``state_dict_saver`` still
               stages through ``_offload_state_dict_to_cpu``.
Upstream:      https://github.com/pytorch/pytorch/pull/145408 (issue
               https://github.com/pytorch/pytorch/issues/144657)
"""

from typing import Any, Dict, Set, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-async-save-cpu-copy",
    summary="dcp.async_save stages a copy of CPU tensors (torch 2.3-2.6 wrote later in-place updates into the checkpoint)",
    torch=">=2.3,<2.7",
    upstream="https://github.com/pytorch/pytorch/pull/145408",
    behaviour="dcp.async_save of CPU tensors updated before the save completes",
    category="correctness",
)


def _tensor_ids(obj: Any, ids: Set[int]) -> Set[int]:
    """The ids of every tensor in a (nested dict/list/tuple) state dict."""
    import torch

    if isinstance(obj, torch.Tensor):
        ids.add(id(obj))
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensor_ids(value, ids)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensor_ids(value, ids)
    return ids


def _unshare(obj: Any, originals: Set[int]) -> Any:
    """``obj`` (a staged state dict) with each tensor whose id is in ``originals`` cloned."""
    import torch

    if isinstance(obj, torch.Tensor):
        if id(obj) not in originals:
            return obj
        with torch.no_grad():
            return obj.clone()  # Tensor, DTensor and ShardedTensor all clone their local data
    if isinstance(obj, dict):
        return {key: _unshare(value, originals) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_unshare(value, originals) for value in obj]
    if isinstance(obj, tuple):
        return tuple(_unshare(value, originals) for value in obj)
    return obj


def _offload_and_copy(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    state_dict = args[0] if args else kwargs["state_dict"]
    return _unshare(wrapped(*args, **kwargs), _tensor_ids(state_dict, set()))


@PATCH.on_import("torch.distributed.checkpoint.staging")
def copy_in_blocking_stager(patcher: Patcher, staging: Any) -> bool:
    import torch

    if not hasattr(staging, "_offload_state_dict_to_cpu") or not hasattr(staging, "BlockingAsyncStager"):
        return False
    probe = torch.zeros(1)
    if staging.BlockingAsyncStager(cache_staged_state_dict=False).stage({"probe": probe})["probe"] is not probe:
        return False  # staging copies already (torch >= 2.7)
    patcher.wrap(staging, "_offload_state_dict_to_cpu", _offload_and_copy)
    return True


@PATCH.on_import("torch.distributed.checkpoint.state_dict_saver")
def copy_in_async_save(patcher: Patcher, saver: Any) -> bool:
    if not hasattr(saver, "async_save") or not hasattr(saver, "_offload_state_dict_to_cpu"):
        return False  # torch < 2.3 (no async_save) or >= 2.7 (stages through a copy)
    patcher.wrap(saver, "_offload_state_dict_to_cpu", _offload_and_copy)
    return True

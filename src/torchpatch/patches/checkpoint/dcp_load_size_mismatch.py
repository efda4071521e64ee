"""dcp-load-size-mismatch: ``dcp.load`` into a tensor whose size differs from the saved one raises,
torch 2.0-2.5.

What breaks:   loading a checkpoint into a state dict whose tensor has another shape than the saved
               one (a grown or shrunk vocabulary or embedding table, a changed hidden size, a model
               config that does not match the checkpoint) succeeds without a word: the default load
               planner reads the saved chunks that overlap the new tensor, so a larger tensor keeps
               its initial values outside the saved region and a smaller one gets a truncated copy
               of the saved one (plain tensors, DTensors and ShardedTensors alike). Training resumes
               from a silently half-loaded model.
Torch:         every torch with ``torch.distributed.checkpoint``'s default planner up to 2.5 (read in
               2.1.2's and 2.4.1's ``default_planner.create_default_local_load_plan``: no size check);
               torch 2.6 added the check (pytorch#141571), 2.9.0 raises ``ValueError: Size mismatch
               between saved torch.Size([4]) and current: torch.Size([6]) for w``.
Fix:           ``default_planner.create_default_local_load_plan``, which the default load planner
               calls to plan its reads, first compares each requested tensor's size (the global
               size, for DTensor and ShardedTensor) with the saved tensor's and raises the same
               ``ValueError`` as torch >= 2.6 on a mismatch; keys the checkpoint lacks and non-tensor
               values are left to torch. Applied only where planning a load of a 6-element tensor
               from a 4-element checkpoint entry does not raise (checked on metadata built in memory).
Upstream:      https://github.com/pytorch/pytorch/pull/141571 (issue
               https://github.com/pytorch/pytorch/issues/126604)
"""

from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-load-size-mismatch",
    summary="dcp.load raises on a tensor whose size differs from the checkpoint's (torch < 2.6 loaded the overlap silently)",
    torch=">=2.0,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/141571",
    behaviour="dcp.load into a state dict whose tensor sizes differ from the checkpoint's",
    category="correctness",
)


def _check_sizes(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ._checkpointable_tensor import _is_checkpointable_tensor

    state_dict = args[0] if args else kwargs["state_dict"]
    metadata = args[1] if len(args) > 1 else kwargs["metadata"]
    saved = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        md = saved.get(fqn)
        if not isinstance(md, TensorStorageMetadata) or not callable(getattr(obj, "size", None)):
            continue
        # a tensor with CheckpointableTensor's fields is a shard of a global tensor (dcp-checkpointable-tensor)
        size = torch.Size(obj.global_shape) if _is_checkpointable_tensor(obj) else obj.size()
        if md.size != size:
            raise ValueError(f"Size mismatch between saved {md.size} and current: {size} for {fqn}")
    return wrapped(*args, **kwargs)


def _plans_a_mismatch(planner: Any) -> bool:
    """Whether ``create_default_local_load_plan`` plans a 6-element load from a 4-element entry."""
    import torch
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                       TensorStorageMetadata)

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    md = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size([4]), chunks=[chunk])
    try:
        planner.create_default_local_load_plan({"w": torch.zeros(6)}, Metadata(state_dict_metadata={"w": md}))
    except ValueError:
        return False
    return True


@PATCH.on_import("torch.distributed.checkpoint.default_planner")
def raise_on_size_mismatch(patcher: Patcher, planner: Any) -> bool:
    if not hasattr(planner, "create_default_local_load_plan") or not _plans_a_mismatch(planner):
        return False  # torch >= 2.6 checks the sizes itself
    patcher.wrap(planner, "create_default_local_load_plan", _check_sizes)
    return True

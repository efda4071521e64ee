"""checkpoint-async-save: ``torch.distributed.checkpoint.async_save`` where ``dcp.save`` exists but
``async_save`` does not, as a synchronous save returning a completed future, torch 2.0-2.2.

What breaks:   torchtitan (mid 2024 and later) saves checkpoints in the background with
               ``self.async_future = dcp.async_save(state, checkpoint_id=path, process_group=pg)`` and
               later waits with ``self.async_future.result()``; with async checkpointing enabled, the
               first save on torch 2.1 dies with ``AttributeError: module
               'torch.distributed.checkpoint' has no attribute 'async_save'``.
Torch:         2.3 added ``async_save`` (it stages the state dict to CPU, then runs ``save`` in a
               thread). Torch 2.0 to 2.2 have no background checkpointing; on 2.0-2.1 ``dcp.save``
               itself comes from the checkpoint-modules patch, which this one requires. Torch 1.13
               gets no ``async_save``, as it gets no ``dcp.save``: its planners cannot flatten the
               nested state dicts that both take (see checkpoint-modules).
Fix:           serve ``async_save(state_dict, *, checkpoint_id=None, storage_writer=None,
               planner=None, process_group=None)`` (torch 2.4's arguments), in
               ``torch.distributed.checkpoint`` and its ``state_dict_saver``: it calls ``dcp.save``
               with them and returns a ``concurrent.futures.Future`` that is already done, holding
               the checkpoint's ``Metadata`` as upstream's future does. **It is synchronous**: the
               call returns once the checkpoint is written, so training does not overlap with the
               write, and nothing needs a CPU process group. The checkpoint is a snapshot taken at
               the call, as upstream's staging makes it; an error raises from the call itself rather
               than from ``result()``.
Upstream:      https://pytorch.org/docs/2.3/distributed.checkpoint.html (``async_save``, torch 2.3)
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Dict, Union

from torchpatch import Patch

PATCH = Patch(
    id="checkpoint-async-save",
    summary="torch.distributed.checkpoint.async_save on torch 2.0-2.2: a synchronous dcp.save returning a completed future",
    torch=">=2.0,<2.3",
    upstream="https://pytorch.org/docs/2.3/distributed.checkpoint.html",
    requires=("checkpoint-modules",),  # dcp.save on torch 2.0-2.1
)


def async_save(state_dict: Dict[str, Any], *, checkpoint_id: Union[str, "os.PathLike[str]", None] = None,
               storage_writer: Any = None, planner: Any = None, process_group: Any = None) -> "Future[Any]":
    """``dcp.save`` with these arguments, run now (synchronously, unlike torch >= 2.3); returns a
    completed ``Future`` holding the resultant ``Metadata``."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                        process_group=process_group)
    future: "Future[Any]" = Future()
    future.set_result(metadata)
    return future


@PATCH.symbol("torch.distributed.checkpoint", "async_save")
def serve_async_save() -> object:
    return async_save


@PATCH.symbol("torch.distributed.checkpoint.state_dict_saver", "async_save")
def serve_saver_async_save() -> object:
    return async_save

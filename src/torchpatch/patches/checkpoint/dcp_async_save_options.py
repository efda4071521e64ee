"""dcp-async-save-options: ``dcp.async_save``'s torch 2.9+ arguments (``async_checkpointer_type``,
``async_stager``, ``no_dist``, ``use_collectives``) and ``state_dict_saver.AsyncCheckpointerType`` /
``AsyncSaveResponse`` on torch 2.4-2.8.

What breaks:   async checkpointing written for torch >= 2.9 (torchtitan:
               ``from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType,
               AsyncSaveResponse``; ``dcp.async_save(state, checkpoint_id=path,
               async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=stager)``) dies
               with ``ImportError: cannot import name 'AsyncSaveResponse'`` (2.4-2.8; also
               ``AsyncCheckpointerType`` on 2.4-2.6) or ``TypeError: async_save() got an unexpected
               keyword argument 'async_stager'``.
Torch:         2.7 added ``AsyncCheckpointerType`` and ``async_checkpointer_type``; 2.9 added
               ``AsyncSaveResponse``, ``async_stager``, ``no_dist`` and ``use_collectives``.
Fix:           serve ``AsyncCheckpointerType`` (``THREAD``/``PROCESS``) and ``AsyncSaveResponse``
               (``staging_completion``, ``upload_completion`` futures) where missing, and extend the
               installed ``async_save`` (in ``torch.distributed.checkpoint`` and
               ``state_dict_saver``) to take the newer arguments, returning what 2.9+ returns: with
               an ``async_stager`` (or ``no_dist=True``) the state dict is staged by that stager
               (else by the storage writer when it is an ``AsyncStager``, else by a synchronous
               ``DefaultStager``) and saved by ``dcp.save`` in a background thread; a stager that
               returns a ``Future`` (``use_async_staging``) gives an ``AsyncSaveResponse``, otherwise
               the save's ``Future`` (holding the ``Metadata``), after ``synchronize_staging()``
               where the stager asks for it. Calls without them go to torch's own ``async_save``.
               ``AsyncCheckpointerType.PROCESS`` saves in a thread where torch has no process
               executor (2.4-2.6) or when a stager is given (2.7-2.8): the same checkpoint and
               ``Future``, written without 2.7+'s separate checkpointing process.
               ``use_collectives=False`` (2.9+'s save without rank coordination, another checkpoint
               layout) raises ``NotImplementedError``.
Upstream:      https://github.com/pytorch/pytorch/pull/156207 (``async_stager``,
               ``AsyncSaveResponse``, torch 2.9); ``AsyncCheckpointerType``: torch 2.7
"""

from __future__ import annotations

import inspect
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Tuple, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="dcp-async-save-options",
    summary="dcp.async_save's async_stager, no_dist, use_collectives and async_checkpointer_type; AsyncSaveResponse",
    torch=">=2.4,<2.9",
    upstream="https://github.com/pytorch/pytorch/pull/156207",
    requires=("dcp-default-stager",),
)

SAVER = "torch.distributed.checkpoint.state_dict_saver"
_NEWER = ("async_stager", "no_dist", "use_collectives")


class AsyncCheckpointerType(Enum):
    """Where ``async_save`` writes the checkpoint: a thread or a separate process."""

    THREAD = "thread"
    PROCESS = "process"


@dataclass
class AsyncSaveResponse:
    """``async_save``'s result for a stager that stages asynchronously: ``staging_completion`` is
    done once the local copy is taken, ``upload_completion`` once the checkpoint is saved."""

    staging_completion: "Future[None]"
    upload_completion: "Future[Any]"


for _cls in (AsyncCheckpointerType, AsyncSaveResponse):
    _cls.__module__ = SAVER


def _save(staged: Any, no_dist: bool, checkpoint_id: Any, storage_writer: Any, planner: Any,
          process_group: Any) -> Any:
    """``dcp.save`` of the staged state dict (a ``Future`` of it is waited for)."""
    import torch.distributed.checkpoint.state_dict_saver as saver

    state_dict = staged.result() if isinstance(staged, Future) else staged
    if not no_dist:
        return saver.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                          process_group=process_group)
    if "no_dist" in inspect.signature(saver.save).parameters:  # torch >= 2.7
        return saver.save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                          process_group=process_group, no_dist=True)
    from torch.distributed.checkpoint._storage_utils import _storage_setup

    writer = _storage_setup(storage_writer, checkpoint_id, reader=False)
    return saver._save_state_dict(state_dict=state_dict, storage_writer=writer, process_group=process_group,
                                  no_dist=True, planner=planner)


def _staged_save(state_dict: Dict[str, Any], async_stager: Any, no_dist: bool, *, checkpoint_id: Any = None,
                 storage_writer: Any = None, planner: Any = None, process_group: Any = None,
                 async_checkpointer_type: Any = None) -> Union["Future[Any]", AsyncSaveResponse]:
    """``async_save`` as torch 2.9 runs it, with a thread executor."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
    import torch.distributed.checkpoint.state_dict_saver as saver

    if dist.is_available() and dist.is_initialized():
        pg = process_group or dist.distributed_c10d._get_default_group()
        if torch.device("cpu") not in pg._device_types:
            raise AssertionError("A CPU backend must be enabled for async save; try initializing process group "
                                 "with 'cpu:gloo,cuda:nccl'")
    owned = None
    if async_stager is None:
        if isinstance(storage_writer, AsyncStager):
            async_stager = storage_writer
        else:
            async_stager = owned = DefaultStager(StagingOptions(False, False, False, False))
    staged = async_stager.stage(saver._stateful_to_state_dict(state_dict))
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="AsyncCheckpointExecutor")
    upload = executor.submit(_save, staged, no_dist, checkpoint_id, storage_writer, planner, process_group)
    upload.add_done_callback(lambda _: executor.shutdown(wait=False))
    if owned is not None:
        upload.add_done_callback(lambda _: owned.close())
    if not isinstance(staged, Future):
        if async_stager.should_synchronize_after_execute:
            async_stager.synchronize_staging()
        return upload
    staging: "Future[None]" = Future()

    def staging_done(done: "Future[Any]") -> None:
        error = done.exception()
        if error is None:
            staging.set_result(None)
        else:
            staging.set_exception(error)

    staged.add_done_callback(staging_done)
    return AsyncSaveResponse(staging_completion=staging, upload_completion=upload)


def _async_save(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    newer = {name: kwargs.pop(name) for name in _NEWER if name in kwargs}
    if newer.get("use_collectives", True) is False:
        raise NotImplementedError("async_save(use_collectives=False) needs torch >= 2.9: saving without rank "
                                  "coordination writes 2.9's per-rank checkpoint layout, which this torch's "
                                  "planners and metadata do not have")
    stager, no_dist = newer.get("async_stager"), bool(newer.get("no_dist", False))
    if stager is None and not no_dist:
        if "async_checkpointer_type" not in inspect.signature(wrapped).parameters:
            kwargs.pop("async_checkpointer_type", None)  # torch < 2.7: a thread is what it has
        return wrapped(*args, **kwargs)
    return _staged_save(*args, async_stager=stager, no_dist=no_dist, **kwargs)


PATCH.symbol(SAVER, "AsyncCheckpointerType")(lambda: AsyncCheckpointerType)
PATCH.symbol(SAVER, "AsyncSaveResponse")(lambda: AsyncSaveResponse)


@PATCH.on_import(SAVER)
def extend_async_save(patcher: Patcher, saver: Any) -> bool:
    """Wrap ``async_save`` (the saver's and the package's, the same function) to take the newer
    arguments."""
    import torch.distributed.checkpoint as dcp

    original = getattr(saver, "async_save", None)
    if original is None or "async_stager" in inspect.signature(original).parameters:
        return False
    for owner in (saver, dcp):
        if getattr(owner, "async_save", None) is original:
            patcher.wrap(owner, "async_save", _async_save)
    return True

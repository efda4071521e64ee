"""dcp-default-stager: ``torch.distributed.checkpoint.staging.DefaultStager`` and ``StagingOptions``
on torch 2.4-2.8.

What breaks:   async checkpointing written for torch >= 2.9 (torchtitan's zero-overhead
               checkpointing: ``from torch.distributed.checkpoint.staging import DefaultStager,
               StagingOptions``, then ``dcp.async_save(..., async_stager=DefaultStager(...))``) dies
               at import with ``ImportError: cannot import name 'DefaultStager' from
               'torch.distributed.checkpoint.staging'``.
Torch:         2.9 added both (read in 2.9.0's and 2.15.0's ``staging.py``); 2.4-2.8 have only
               ``AsyncStager`` and ``BlockingAsyncStager``.
Fix:           serve ``StagingOptions`` (the dataclass: ``use_pinned_memory``,
               ``use_shared_memory``, ``use_async_staging``, ``use_non_blocking_copy``, all ``True``
               by default) and ``DefaultStager(config=StagingOptions())``, an ``AsyncStager`` whose
               ``stage(state_dict)`` returns a copy of the state dict in new CPU tensors (plain
               tensors, DTensors, ShardedTensors: the installed ``_create_cpu_state_dict`` and
               ``_copy_state_dict``, in pinned memory where CUDA is available and asked for, in
               shared memory where asked for), from a one-thread pool as a ``Future`` with
               ``use_async_staging``; ``synchronize_staging()`` waits for it, ``close()`` shuts the
               pool down. As on 2.9+, a non-blocking copy needs an accelerator: without one,
               ``DefaultStager`` raises ``AssertionError`` unless ``use_non_blocking_copy=False``.
               Values other than tensors and containers are shared with the caller, not deep-copied
               as 2.9+'s stager does (DCP pickles them at the write).
Upstream:      https://github.com/pytorch/pytorch/pull/156207 (zero-overhead checkpointing:
               DefaultStager, torch 2.9)
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

from torchpatch import Patch

PATCH = Patch(
    id="dcp-default-stager",
    summary="torch.distributed.checkpoint.staging.DefaultStager and StagingOptions: staging a state dict to CPU",
    torch=">=2.4,<2.9",
    upstream="https://github.com/pytorch/pytorch/pull/156207",
)

MODULE = "torch.distributed.checkpoint.staging"
STATE_DICT = Dict[str, Any]


@dataclass
class StagingOptions:
    """How ``DefaultStager`` stages: pinned and/or shared CPU memory, in a background thread, with
    non-blocking device copies."""

    use_pinned_memory: bool = True
    use_shared_memory: bool = True
    use_async_staging: bool = True
    use_non_blocking_copy: bool = True


def _accelerator() -> Any:
    """``torch.accelerator`` (torch >= 2.6), else ``torch.cuda``: both have ``is_available`` and
    ``synchronize``."""
    import torch

    return getattr(torch, "accelerator", torch.cuda)


def _default_stager() -> type:
    from torch.distributed.checkpoint.staging import AsyncStager

    class DefaultStager(AsyncStager):
        """Stages a state dict into new CPU tensors, synchronously or in a background thread."""

        def __init__(self, config: StagingOptions = StagingOptions()) -> None:
            import torch

            self._config = config
            self._pin_memory = config.use_pinned_memory and torch.cuda.is_available()
            if config.use_pinned_memory and not self._pin_memory:
                warnings.warn("Ignoring pin_memory flag for checkpoint staging as pinning memory requires CUDA")
            self._staging_executor: Optional[ThreadPoolExecutor] = (
                ThreadPoolExecutor(max_workers=1) if config.use_async_staging else None)
            if config.use_non_blocking_copy and not _accelerator().is_available():
                raise AssertionError("Non-blocking copy requires that the current accelerator is available.")
            self._staging_future: Optional["Future[STATE_DICT]"] = None

        def stage(self, state_dict: STATE_DICT, **kwargs: Any) -> Union[STATE_DICT, "Future[STATE_DICT]"]:
            """A CPU copy of ``state_dict``; with ``use_async_staging``, a ``Future`` of it."""
            if self._staging_executor is None:
                return self._stage(state_dict)
            self._staging_future = self._staging_executor.submit(self._stage, state_dict)
            return self._staging_future

        def _stage(self, state_dict: STATE_DICT) -> STATE_DICT:
            from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

            staged = _create_cpu_state_dict(state_dict, pin_memory=self._pin_memory,
                                            share_memory=self._config.use_shared_memory)
            non_blocking = self._config.use_non_blocking_copy
            staged = _copy_state_dict(state_dict, staged, non_blocking=non_blocking, type_check=False)
            if non_blocking:
                _accelerator().synchronize()
            return staged

        def synchronize_staging(self) -> None:
            """Wait until the last asynchronous staging is complete (nothing to wait for otherwise)."""
            if self._staging_future is not None:
                self._staging_future.result()

        def close(self) -> None:
            """Shut the staging thread down."""
            if self._staging_executor is not None:
                self._staging_executor.shutdown(wait=True)

    DefaultStager.__module__ = MODULE
    return DefaultStager


StagingOptions.__module__ = MODULE
PATCH.symbol(MODULE, "StagingOptions")(lambda: StagingOptions)
PATCH.symbol(MODULE, "DefaultStager")(_default_stager)

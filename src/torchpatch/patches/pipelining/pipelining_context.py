"""pipelining-context: ``torch.distributed.pipelining.schedules._PipelineContext``, torch 2.4-2.9.

What breaks:   torchtitan 0.2.2 imports it at module level with its DualPipeV overlap callback
               (``torchtitan/distributed/dual_pipe_v.py``, imported by every model's pipeline code),
               so on torch 2.9 nothing trains, pipelined or not: ``ImportError: cannot import name
               '_PipelineContext' from 'torch.distributed.pipelining.schedules'``.
Torch:         2.4-2.9 have ``torch.distributed.pipelining`` without it; 2.10 added it with the custom
               functions a ``_PipelineScheduleRuntime`` calls for an action
               (``register_custom_function``).
Fix:           serve it: torch 2.15's value handed to a custom function, a dataclass of
               ``schedule_ref`` and the step's ``arg_mbs``, ``kwarg_mbs``, ``target_mbs`` and
               ``losses`` (each defaulting to None). Not served: ``register_custom_function``, so no
               schedule of these torches builds one (torchtitan registers its callback only for
               DualPipeV with expert parallelism; that stays an ``AttributeError``).
Upstream:      https://github.com/pytorch/pytorch/tree/v2.10.0/torch/distributed/pipelining/schedules.py
               (``_PipelineContext``, custom functions of the schedule runtime)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from torchpatch import Patch

PATCH = Patch(
    id="pipelining-context",
    summary="torch.distributed.pipelining.schedules._PipelineContext (a custom function's context)",
    torch=">=2.4,<2.10",
    upstream="https://github.com/pytorch/pytorch/tree/v2.10.0/torch/distributed/pipelining/schedules.py",
)

SCHEDULES = "torch.distributed.pipelining.schedules"


@dataclass
class _PipelineContext:
    """Context passed to custom functions during pipeline execution."""

    schedule_ref: Any
    arg_mbs: Optional[List[Tuple[Any, ...]]] = None
    kwarg_mbs: Optional[List[Dict[str, Any]]] = None
    target_mbs: Optional[List[Any]] = None
    losses: Optional[List[Any]] = None


@PATCH.symbol(SCHEDULES, "_PipelineContext")
def serve_context() -> type:
    _PipelineContext.__module__ = SCHEDULES
    return _PipelineContext

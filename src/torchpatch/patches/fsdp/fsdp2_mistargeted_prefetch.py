"""fsdp2-mistargeted-prefetch: FSDP2 drops an all-gather that a backward prefetch issued but no
module waited for, so the next iteration all-gathers the updated parameters, torch 2.4-2.5.

What breaks:   FSDP2 prefetches in backward by the reverse of the recorded post-forward order. When
               the forwards and backwards do not pair up one to one, the last backward of an
               iteration can prefetch (``unshard``: issue the all-gather) a parameter group whose
               backward has already run, and nothing waits for it. Torch 2.4 keeps that pending
               all-gather result past the optimizer step; the next iteration's ``unshard`` is then a
               no-op and its forward copies out the parameters all-gathered *before* the step.
               Nothing fails: training silently runs a stale model. Seen with pipeline parallelism:
               ``ScheduleInterleaved1F1B`` over FSDP2 stages (two stages a rank,
               ``reshard_after_forward=False``, torchtitan 0.1.0's ``pp+fsdp+tp``) whose stages
               learn their shapes at the first step (``PipelineStage`` without ``input_args``: one
               extra forward): step 1 equals one process, from step 2 the loss is higher.
Torch:         2.4 (read in 2.4.1's ``_composable/fsdp/_fsdp_param_group.py``: ``finalize_backward``
               leaves ``_all_gather_result`` alone); 2.5 has the same code (not in CI's matrix).
               torch 2.6 clears it (read in 2.9.0's ``fsdp/_fully_shard``).
Fix:           as upstream: at the end of the last backward (``FSDPParamGroup.finalize_backward``),
               a group still holding an all-gather result waits for it (its event on the current
               stream, its work) and drops it, so the next ``unshard`` all-gathers the sharded
               parameters as the optimizer left them.
Upstream:      https://github.com/pytorch/pytorch/pull/137348 (torch 2.6)
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Dict, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="fsdp2-mistargeted-prefetch",
    summary="FSDP2 drops a backward prefetch's all-gather that nothing waited for at the end of backward "
            "(torch < 2.6 used its stale parameters in the next forward)",
    torch=">=2.4,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/137348",
    behaviour="FSDP2 whose backward prefetch unshards a group after its backward (pipeline schedules)",
    category="correctness",
)


def _finalize_backward(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """torch's ``finalize_backward``, then wait for and drop a pending all-gather result."""
    result = wrapped(*args, **kwargs)
    pending = instance._all_gather_result
    if pending is not None:
        # The module's ``torch`` (fsdp2-cpu gives it a CPU stream handle where CUDA is absent).
        torch = sys.modules[type(instance).__module__].torch
        if pending.all_gather_event is not None:
            torch.cuda.current_stream().wait_event(pending.all_gather_event)
        work = pending.all_gather_work
        if work is not None and hasattr(work, "wait"):
            work.wait()
        instance._all_gather_result = None
    return result


@PATCH.on_import("torch.distributed._composable.fsdp._fsdp_param_group")
def _patch(patcher: Patcher, module: ModuleType) -> bool:
    group = module.FSDPParamGroup
    if not hasattr(group, "finalize_backward"):
        return False
    patcher.wrap(group, "finalize_backward", _finalize_backward)
    return True

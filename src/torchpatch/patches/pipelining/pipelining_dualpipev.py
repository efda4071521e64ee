"""pipelining-dualpipev: ``ScheduleDualPipeV`` for torch 2.4-2.8's pipelining.

What breaks:   code written for torch >= 2.9 that picks DeepSeek's DualPipeV schedule does
               ``from torch.distributed.pipelining.schedules import ScheduleDualPipeV`` (or
               ``get_schedule_class("DualPipeV")``) and dies on torch 2.4 with ``ImportError: cannot
               import name 'ScheduleDualPipeV'``.
Torch:         2.4-2.8 (2.9 added the schedule). 2.5-2.8's own ``_PipelineScheduleRuntime`` cannot run it
               on gloo: it sends the activations between a rank's two V stages through the process group
               to its own rank ("Pair is not connected"). Older torch has no pipelining to build on.
               2.5-2.8 are not in CI's matrix: tested on 2.5.1 and 2.8.0 by hand (temporary venvs) at
               7c8f71b, not in CI.
Fix:           serve it on ``pipelining-zbv``'s ``_PipelineScheduleRuntime`` (torch's own ``PipelineStage``
               and ``PipelineScheduleMulti``; on 2.5-2.8 a subclass of torch's ``_PipelineScheduleRuntime``
               that hands a rank's V activations over in-process), with torch 2.15's action order:
               two stages per rank in a V (rank ``r`` holds stages ``r`` and ``2W-1-r``), per rank
               forwards of the first stage, then of both, input / weight backward steps, the main part
               of overlapped steps (a forward of one microbatch and a backward of another), and the
               backwards and remaining weight backwards to finish. The runtime has no overlapped action:
               it runs the forward, then the backward (the same values); on torch 2.4, as for ZB-V there,
               the stage computes input and weight gradients together: ``I`` runs the whole backward and
               ``W`` nothing, so losses, outputs and gradients are the schedule's, its timing is not
               DualPipeV's (2.5+ split them). torch's own ``get_schedule_class("DualPipeV")`` (2.5-2.8)
               returns the served class. 2.15's errors: not 2 stages per rank, fewer microbatches than
               stages.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/schedules.py
               (``ScheduleDualPipeV``, torch 2.9); https://github.com/deepseek-ai/DualPipe
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, DefaultDict, Dict, List, Optional, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._reexport import reexport
from torchpatch.patches.pipelining.pipelining_zbv import _Action, runtime_classes, serve_in_lookup, v_placement

PATCH = Patch(
    id="pipelining-dualpipev",
    summary="torch.distributed.pipelining.schedules.ScheduleDualPipeV on torch 2.4-2.8 (on pipelining-zbv's "
    "action-list runtime; overlapped steps run as a forward then a backward)",
    torch=">=2.4,<2.9",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/schedules.py",
)

SCHEDULES = "torch.distributed.pipelining.schedules"


def dualpipev_order(rank: int, group_size: int, n_microbatches: int) -> List[_Action]:
    """``rank``'s actions in torch 2.15's ``ScheduleDualPipeV`` order, each overlapped step as its
    forward followed by its backward."""
    first, second = rank, 2 * group_size - 1 - rank
    next_mb: DefaultDict[Tuple[int, str], int] = defaultdict(int)  # (stage, "F" or "B") -> microbatch
    weights: List[Tuple[int, int]] = []  # (stage, microbatch) of input backwards awaiting their W
    order: List[_Action] = []

    def run(stage: int, kind: str) -> None:
        key = (stage, "F" if kind == "F" else "B")
        order.append(_Action(stage, kind, next_mb[key]))
        if kind == "I":
            weights.append((stage, next_mb[key]))
        next_mb[key] += 1

    def weight() -> None:
        if weights:
            order.append(_Action(weights[0][0], "W", weights.pop(0)[1]))

    others = group_size - rank - 1  # the ranks after this one
    for _ in range(2 * others):
        run(first, "F")
    for _ in range(rank + 1):
        run(first, "F")
        run(second, "F")
    for _ in range(others):
        run(second, "I")
        weight()
        run(second, "F")
    for _ in range(n_microbatches - 2 * group_size + rank + 1):
        run(first, "F")  # overlapped with the next backward but on the last rank's first step
        run(second, "B")
        run(second, "F")  # overlapped
        run(first, "B")
    for _ in range(others):
        run(second, "B")
        run(second, "F")  # overlapped
        run(first, "B")
    zero_bubble = False  # the second half of the last backwards split off their weight backward
    half = (rank + 1) // 2
    for i in range(rank + 1):
        zero_bubble = zero_bubble or (i == half and rank % 2 == 1)
        run(second, "I" if zero_bubble else "B")
        zero_bubble = zero_bubble or (i == half and rank % 2 == 0)
        run(first, "I" if zero_bubble else "B")
    for _ in range(others):
        weight()
        run(first, "I" if zero_bubble else "B")
    for _ in range(rank + 1):
        weight()
    return order


@PATCH.symbol(SCHEDULES, "ScheduleDualPipeV")
def serve_schedule() -> type:
    """The schedule, on top of ``pipelining-zbv``'s ``_PipelineScheduleRuntime`` (not torch 2.5-2.8's own)."""

    class ScheduleDualPipeV(runtime_classes()["_PipelineScheduleRuntime"]):  # type: ignore[misc, valid-type]
        """The DualPipeV schedule (DeepSeek, https://arxiv.org/pdf/2412.19437): two stages per rank in
        a V. An overlapped step runs its forward then its backward; on torch 2.4 I steps run the whole
        backward and W steps nothing."""

        __module__ = SCHEDULES

        def __init__(self, stages: List[Any], n_microbatches: int, loss_fn: Optional[Callable] = None,
                     args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None, output_merge_spec: Any = None,
                     scale_grads: bool = True) -> None:
            group_size, num_stages = stages[0].group_size, stages[0].num_stages
            if len(stages) != 2:  # before torch 2.4's own check (at least two stages), to raise 2.15's error
                raise ValueError(f"ZBV requires exactly 2 stages per rank, but got {len(stages)}.")
            if n_microbatches < num_stages:
                raise ValueError("DualPipeV requires at least as many microbatches as stages, but got "
                                 f"{n_microbatches} microbatches and {num_stages} stages.")
            placement = v_placement(group_size, num_stages)
            for stage in stages:
                stage.stage_index_to_group_rank = dict(placement)
            super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                             output_merge_spec, scale_grads)
            self.pp_group_size = group_size
            self.n_local_stages = len(stages)
            self._load_actions({r: dualpipev_order(r, group_size, n_microbatches) for r in range(group_size)})

    return ScheduleDualPipeV


@PATCH.on_import(SCHEDULES)
def dualpipev_in_lookup(patcher: Patcher, schedules: Any) -> bool:
    return serve_in_lookup(patcher, schedules, "DualPipeV", "ScheduleDualPipeV")

# torch 2.15's torch.distributed.pipelining re-exports it
PATCH.symbol("torch.distributed.pipelining", "ScheduleDualPipeV")(reexport(SCHEDULES, "ScheduleDualPipeV"))

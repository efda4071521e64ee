"""pipelining-interleaved-zb: ``ScheduleInterleavedZeroBubble`` for torch 2.4's pipelining.

What breaks:   code written for torch >= 2.5 that picks the interleaved zero-bubble schedule does
               ``from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble`` (or
               ``get_schedule_class("InterleavedZeroBubble")``) and dies on torch 2.4 with
               ``ImportError: cannot import name 'ScheduleInterleavedZeroBubble'``.
Torch:         2.4 (2.5 added the schedule). Older torch has no pipelining to build on.
Fix:           serve it on the ``_PipelineScheduleRuntime`` that ``pipelining-zbv`` serves on 2.4 (torch
               2.4's own ``PipelineStage`` and ``PipelineScheduleMulti``), with torch 2.15's action order:
               several stages per rank in torch 2.4's looped placement (stage ``s`` on rank
               ``s % W``), ``max(1, n // W)`` rounds of microbatches, per rank a warm-up of forwards,
               then forward / input-backward / weight-backward steps (the weight backward held back
               by ``rank`` steps), the remaining weight backwards at the end, and a bubble wherever a
               forward's input is not produced by an earlier step. As for ZB-V there, torch 2.4's
               stage computes the input and weight gradients together: ``I`` runs the whole backward
               and ``W`` nothing, so losses, outputs and gradients are the schedule's, its timing is
               not zero-bubble. A number of microbatches that is not a multiple of the rounds raises
               2.15's ``ValueError``.
Upstream:      https://github.com/pytorch/pytorch/tree/v2.5.0/torch/distributed/pipelining/schedules.py (torch 2.5); the
               order as of https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/schedules.py
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, DefaultDict, Dict, List, Optional, Set, Tuple

from torchpatch import Patch
from torchpatch.patches._reexport import reexport
from torchpatch.patches.pipelining.pipelining_zbv import _Action

PATCH = Patch(
    id="pipelining-interleaved-zb",
    summary="torch.distributed.pipelining.schedules.ScheduleInterleavedZeroBubble on torch 2.4 "
    "(on pipelining-zbv's action-list runtime)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/tree/v2.5.0/torch/distributed/pipelining/schedules.py",
    requires=("pipelining-zbv",),
)

SCHEDULES = "torch.distributed.pipelining.schedules"
Order = List[Optional[_Action]]


def _rank_order(rank: int, group_size: int, n_local: int, n_microbatches: int, per_round: int) -> Order:
    """One rank's actions before bubbles: warm-up forwards, then F/I/W steps, then the last I/W."""
    warmup = min((n_local - 1) * per_round + group_size - 1 - rank, n_microbatches * n_local)
    steady = n_local * n_microbatches - warmup

    def forward_stage(step: int) -> int:
        return (step // per_round) % n_local * group_size + rank

    def backward_stage(step: int) -> int:
        return (n_local - 1 - (step - warmup) // per_round % n_local) * group_size + rank

    done: DefaultDict[Tuple[str, int], int] = defaultdict(int)  # (kind, stage) -> next microbatch

    def action(kind: str, stage: int) -> _Action:
        done[(kind, stage)] += 1
        return _Action(stage, kind, done[(kind, stage)] - 1)

    order: Order = [None] * rank
    backward_steps: List[int] = []  # the step of each input backward, in order: the weight backwards follow them
    for step in range(2 * warmup + steady):
        if step < warmup + steady:
            order.append(action("F", forward_stage(step)))
        if step == warmup - 1:
            order += [None] * (group_size - rank - 1)
        if step >= warmup:
            order.append(action("I", backward_stage(step)))
            backward_steps.append(step)
            if step - warmup >= rank:
                order.append(action("W", backward_stage(backward_steps[_weights(done)])))
    while _weights(done) < len(backward_steps):
        order.append(action("W", backward_stage(backward_steps[_weights(done)])))
    return order


def _weights(done: Dict[Tuple[str, int], int]) -> int:
    """How many weight backwards were issued so far."""
    return sum(count for (kind, _), count in done.items() if kind == "W")


def _with_bubbles(orders: Dict[int, Order]) -> Dict[int, Order]:
    """Step all ranks together; a rank whose next forward's input stage has not run it yet idles."""
    seen: Set[Tuple[int, str, int]] = set()
    result: Dict[int, Order] = {rank: [] for rank in orders}
    at = {rank: 0 for rank in orders}
    while any(at[rank] < len(orders[rank]) for rank in orders):
        new: Set[Tuple[int, str, int]] = set()
        for rank, order in orders.items():
            if at[rank] >= len(order):
                continue
            a = order[at[rank]]
            if (a is not None and a.computation_type == "F" and a.stage_index != 0
                    and (a.stage_index - 1, "F", a.microbatch_index) not in seen):
                result[rank].append(None)
                continue
            result[rank].append(a)
            at[rank] += 1
            if a is not None:
                new.add((a.stage_index, a.computation_type, a.microbatch_index))
        seen |= new
    return result


def interleaved_zb_orders(group_size: int, n_local: int, n_microbatches: int) -> Dict[int, Order]:
    """Every rank's action list of torch 2.15's ``ScheduleInterleavedZeroBubble``."""
    rounds = max(1, n_microbatches // group_size)
    if n_microbatches % rounds != 0:
        raise ValueError("Zero bubble requires the number of microbatches to be a multiple of the number of "
                         f"rounds ({rounds}), but got {n_microbatches}.")
    per_round = n_microbatches // rounds
    return _with_bubbles({rank: _rank_order(rank, group_size, n_local, n_microbatches, per_round)
                          for rank in range(group_size)})


def make_schedule_class(runtime: type) -> type:
    """The schedule, on top of ``pipelining-zbv``'s ``_PipelineScheduleRuntime``."""

    class ScheduleInterleavedZeroBubble(runtime):  # type: ignore[misc, valid-type]
        """The interleaved zero-bubble schedule (https://arxiv.org/pdf/2401.10241): several stages per
        rank, looped placement. On torch 2.4 its I steps run the whole backward and W steps nothing."""

        def __init__(self, stages: List[Any], n_microbatches: int, loss_fn: Optional[Callable] = None,
                     args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None, output_merge_spec: Any = None,
                     scale_grads: bool = True) -> None:
            super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                             output_merge_spec, scale_grads)
            self.pp_group_size = stages[0].group_size
            self.n_local_stages = len(stages)
            self._load_actions(interleaved_zb_orders(self.pp_group_size, self.n_local_stages, n_microbatches))

    return ScheduleInterleavedZeroBubble


@PATCH.symbol(SCHEDULES, "ScheduleInterleavedZeroBubble")
def serve_schedule() -> type:
    import torch.distributed.pipelining.schedules as schedules

    cls = make_schedule_class(schedules._PipelineScheduleRuntime)
    cls.__module__ = SCHEDULES
    return cls

# torch 2.15's torch.distributed.pipelining re-exports it
PATCH.symbol("torch.distributed.pipelining", "ScheduleInterleavedZeroBubble")(reexport(SCHEDULES, "ScheduleInterleavedZeroBubble"))

"""pipelining-activation-liveness: ``analyze_pipeline_activation_liveness`` and
``PipelineActivationLiveness`` (activation slots of a pipeline schedule), torch 2.4-2.14.

What breaks:   code written for torch 2.15 that plans activation buffers from its schedule does
               ``from torch.distributed.pipelining.schedules import analyze_pipeline_activation_liveness``
               (or from ``torch.distributed.pipelining``) and dies with ``ImportError: cannot import
               name 'analyze_pipeline_activation_liveness'``.
Torch:         2.4-2.14 have the schedules and their per-rank action lists (``pipeline_order``; for
               ``_PipelineScheduleRuntime``, 2.5 on, ``pipeline_order_with_comms``) but not the
               analysis, which 2.15 added.
Fix:           serve both names in ``schedules`` and in the package, with 2.15's semantics: walk the
               finalized action list of ``pp_rank`` (the with-communication list of a runtime schedule,
               the compute list otherwise, bubbles kept as positions); a forward starts a
               ``(stage, microbatch)`` lifetime, a full backward or a weight backward ends it (an input
               backward does not); per-pair or per-microbatch (convex hull over the selected stages)
               lifetimes get slots greedily by (start, release, input order), a slot reused only once its
               interval ended before the next one starts; the same ``ValueError``s as 2.15 for a bad
               granularity, stage selection, absent rank or an incomplete schedule. On torch 2.5, whose
               zero-bubble schedules write an input backward as ``B`` followed by ``W``, a ``B`` whose
               pair also has a ``W`` counts as the input backward.
Upstream:      torch 2.15 (``analyze_pipeline_activation_liveness``), see
               https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/schedules.py
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from torchpatch import Patch

PATCH = Patch(
    id="pipelining-activation-liveness",
    summary="torch.distributed.pipelining.schedules.analyze_pipeline_activation_liveness and "
    "PipelineActivationLiveness (reusable activation slots of a schedule)",
    torch=">=2.4,<2.15",
    upstream="https://github.com/pytorch/pytorch/tree/v2.15.0/torch/distributed/pipelining/schedules.py",
)

SCHEDULES = "torch.distributed.pipelining.schedules"
GRANULARITIES = ("microbatch", "stage_microbatch")
_COMPUTE = ("F", "I", "B", "W", "OVERLAP_F_B")
Key = Tuple[int, int]


@dataclass(frozen=True)
class PipelineActivationLiveness:
    """Reusable activation slots derived from a pipeline schedule (torch 2.15's result type).

    ``slot_by_stage_and_microbatch`` maps each ``(stage_index, microbatch_index)`` to a logical slot
    ID; ``num_slots`` is how many slots the assignment needs. Instances are returned by
    :func:`analyze_pipeline_activation_liveness`.
    """

    pp_rank: int
    granularity: str
    stage_indices: Tuple[int, ...]
    num_microbatches: int
    slot_by_stage_and_microbatch: Mapping[Key, int]
    num_slots: int
    _activation_lifetime_by_stage_and_microbatch: Mapping[Key, Tuple[int, int]] = field(repr=False)
    __hash__ = None  # type: ignore[assignment]  # the mappings are unhashable

    def slot_for(self, stage_index: int, microbatch_index: int) -> int:
        """The activation slot of a stage and microbatch; ``ValueError`` if not analysed."""
        try:
            return self.slot_by_stage_and_microbatch[(stage_index, microbatch_index)]
        except KeyError as error:
            raise ValueError(
                f"No activation slot exists for stage {stage_index}, microbatch {microbatch_index}") from error

    def get_activation_lifetime(self, stage_index: int, microbatch_index: int) -> Tuple[int, int]:
        """The inclusive ``(forward_position, release_position)`` of an activation in the analysed
        action list; ``ValueError`` if not analysed."""
        try:
            return self._activation_lifetime_by_stage_and_microbatch[(stage_index, microbatch_index)]
        except KeyError as error:
            raise ValueError(
                f"No activation lifetime exists for stage {stage_index}, microbatch {microbatch_index}") from error


def assign_slots(intervals: Sequence[Tuple[int, int]]) -> Tuple[List[int], int]:
    """One slot per inclusive interval (in input order) and the number of slots: intervals taken by
    (start, release, input order), each given the lowest slot whose interval ended before it starts."""
    active: List[Tuple[int, int]] = []  # (release, slot)
    free: List[int] = []
    slots = [-1] * len(intervals)
    count = 0
    for index, (start, release) in sorted(enumerate(intervals), key=lambda item: (item[1], item[0])):
        while active and active[0][0] < start:
            heapq.heappush(free, heapq.heappop(active)[1])
        if free:
            slot = heapq.heappop(free)
        else:
            slot, count = count, count + 1
        slots[index] = slot
        heapq.heappush(active, (release, slot))
    return slots, count


class _Boundaries:
    """Forward and release positions of the tracked ``(stage, microbatch)`` pairs in one action list."""

    def __init__(self, stages: Set[int], num_microbatches: int, b_may_be_input: bool) -> None:
        self.stages, self.num_microbatches = stages, num_microbatches
        self.forward: Dict[Key, int] = {}
        self.release: Dict[Key, int] = {}
        self.input_backward: Set[Key] = set()
        self.weight_backward: Set[Key] = set()
        self._b_may_be_input = b_may_be_input

    def record(self, actions: Sequence[Optional[Any]]) -> None:
        flat = [(position, a) for position, action in enumerate(actions) for a in _leaves(action)]
        weights = {(a.stage_index, a.microbatch_index) for _, a in flat if _kind(a) == "W"}
        for position, action in flat:
            kind = _kind(action)
            if kind not in _COMPUTE or action.stage_index not in self.stages:
                continue
            mb = action.microbatch_index
            if mb is None:
                raise ValueError(f"Compute action {action} has no microbatch index")
            if not 0 <= mb < self.num_microbatches:
                raise ValueError(f"Action {action} has a microbatch outside [0, {self.num_microbatches})")
            key = (action.stage_index, mb)
            if kind == "B" and self._b_may_be_input and key in weights:
                kind = "I"  # torch 2.5: "B" then "W" is the split backward
            if kind == "F":
                if key in self.forward:
                    raise ValueError(f"Activation lifetime {key} has multiple forwards")
                self.forward[key] = position
            elif kind == "I":
                if key in self.input_backward:
                    raise ValueError(f"Activation lifetime {key} has multiple input backwards")
                self.input_backward.add(key)
            elif kind in ("B", "W"):
                if key in self.release:
                    raise ValueError(f"Activation lifetime {key} has multiple release actions")
                self.release[key] = position
                if kind == "W":
                    self.weight_backward.add(key)

    def check(self, expected: Set[Key]) -> None:
        """2.15's errors for a schedule without exactly one lifetime per expected pair."""
        for what, got in (("Forward actions do not match tracked activations", self.forward),
                          ("Backward release actions do not match tracked activations", self.release)):
            if set(got) != expected:
                missing, extra = sorted(expected - set(got)), sorted(set(got) - expected)
                raise ValueError(f"{what}; missing={missing!r}, extra={extra!r}")
        unpaired = self.weight_backward - self.input_backward
        if unpaired:
            raise ValueError(f"Activation lifetimes have weight backward without input backward: {sorted(unpaired)}")
        for key in expected:
            if self.release[key] < self.forward[key]:
                raise ValueError(f"Activation lifetime {key} ends before its forward")


def _kind(action: Any) -> str:
    """``"F"``, ``"I"``, ``"B"``, ``"W"``, ... of an action: its computation type's value where that is the
    string (torch >= 2.14), else the type's ``str`` (an int-valued enum's, or a plain string)."""
    value = getattr(action.computation_type, "value", None)
    return value if isinstance(value, str) else str(action.computation_type)


def _leaves(action: Optional[Any]) -> List[Any]:
    """The action itself, or the sub-actions of a compound one (none for a bubble)."""
    if action is None:
        return []
    subs = getattr(action, "sub_actions", None)
    return [leaf for sub in subs for leaf in _leaves(sub)] if subs is not None else [action]


def make_analyze(schedules: Any) -> Any:
    """``analyze_pipeline_activation_liveness`` bound to the installed torch's ``schedules`` module."""
    computation_type = getattr(schedules, "_ComputationType", None)
    b_may_be_input = computation_type is not None and not hasattr(computation_type, "BACKWARD_INPUT")

    def analyze_pipeline_activation_liveness(schedule: Any, *, pp_rank: int, stage_indices: Sequence[int],
                                             granularity: str) -> PipelineActivationLiveness:
        """Activation lifetimes of ``stage_indices`` on ``pp_rank`` in ``schedule``'s finalized action list,
        and reusable slots for them (torch 2.15's analysis; see the patch's docstring)."""
        if granularity not in GRANULARITIES:
            raise ValueError(f"Unsupported activation granularity: {granularity}")
        tracked = tuple(stage_indices)
        if not tracked:
            raise ValueError("stage_indices must not be empty")
        if len(set(tracked)) != len(tracked):
            raise ValueError("stage_indices must be unique")
        # a runtime schedule's list with communication; a compute+comms CSV may fill only that one
        order = getattr(schedule, "pipeline_order_with_comms", None)
        order = schedule.pipeline_order if order is None else order
        if pp_rank not in order:
            raise ValueError(f"Rank {pp_rank} is not present in the pipeline schedule")
        n = schedule._n_microbatches
        found = _Boundaries(set(tracked), n, b_may_be_input)
        found.record(order[pp_rank])
        expected = {(s, mb) for s in tracked for mb in range(n)}
        found.check(expected)
        keys = sorted(expected)
        if granularity == "microbatch":
            per_mb = [(min(found.forward[(s, mb)] for s in tracked), max(found.release[(s, mb)] for s in tracked))
                      for mb in range(n)]
            mb_slots, num_slots = assign_slots(per_mb)
            slots = {key: mb_slots[key[1]] for key in keys}
            lifetimes = {key: per_mb[key[1]] for key in keys}
        else:
            lifetimes = {key: (found.forward[key], found.release[key]) for key in keys}
            slot_list, num_slots = assign_slots([lifetimes[key] for key in keys])
            slots = dict(zip(keys, slot_list))
        return PipelineActivationLiveness(
            pp_rank=pp_rank, granularity=granularity, stage_indices=tracked, num_microbatches=n,
            slot_by_stage_and_microbatch=MappingProxyType(slots), num_slots=num_slots,
            _activation_lifetime_by_stage_and_microbatch=MappingProxyType(lifetimes))

    return analyze_pipeline_activation_liveness


@PATCH.symbol(SCHEDULES, "analyze_pipeline_activation_liveness")
def serve_analyze() -> Any:
    import torch.distributed.pipelining.schedules as schedules

    return make_analyze(schedules)


@PATCH.symbol(SCHEDULES, "PipelineActivationLiveness")
def serve_result_type() -> type:
    PipelineActivationLiveness.__module__ = SCHEDULES
    return PipelineActivationLiveness


def _from_schedules(name: str) -> Any:
    def factory() -> Any:
        import torch.distributed.pipelining.schedules as schedules

        return getattr(schedules, name)

    return factory


for _name in ("analyze_pipeline_activation_liveness", "PipelineActivationLiveness"):
    PATCH.symbol("torch.distributed.pipelining", _name)(_from_schedules(_name))

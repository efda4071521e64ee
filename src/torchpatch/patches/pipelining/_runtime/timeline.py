"""The timeline: the compute actions of a schedule (``_Action``), the global time steps all ranks
place them at alike (``_timeline``), what one rank does and receives at each step (``_events``)
and the gloo tag of each message (``_tag``)."""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from .stage import _PREFIX


class _Action(NamedTuple):
    """One compute action: ``F`` (forward) or ``B`` (full backward) of a stage on a microbatch."""

    stage_index: int
    computation_type: str
    microbatch_index: int

    def __repr__(self) -> str:
        return f"{self.stage_index}{self.computation_type}{self.microbatch_index}"


class _Message(NamedTuple):
    """A message produced at one step: ``F`` activations for ``stage`` or ``B`` gradients for it."""

    kind: str
    stage: int
    mb: int
    src_stage: int


def _deps(action: _Action, num_stages: int) -> Tuple[_Action, ...]:
    s, kind, mb = action
    if kind == "F":
        return (_Action(s - 1, "F", mb),) if s > 0 else ()
    return (_Action(s, "F", mb),) + ((_Action(s + 1, "B", mb),) if s < num_stages - 1 else ())


def _timeline(orders: Sequence[Sequence[_Action]], num_stages: int) -> List[List[Tuple[int, _Action]]]:
    """Place every rank's actions, in its order, at the earliest step after their inputs were
    produced (by an action at an earlier step). Raises if the orders cannot run."""
    done: Dict[_Action, int] = {}
    pos = [0] * len(orders)
    placed: List[List[Tuple[int, _Action]]] = [[] for _ in orders]
    step, left = 0, sum(len(o) for o in orders)
    while left:
        heads = [(r, orders[r][pos[r]]) for r in range(len(orders)) if pos[r] < len(orders[r])]
        ready = [(r, a) for r, a in heads if all(done.get(d, step) < step for d in _deps(a, num_stages))]
        if not ready:
            raise ValueError(f"{_PREFIX}: the schedule cannot run: each rank's next action waits on another "
                             f"one that never runs ({dict(heads)})")
        for r, action in ready:
            done[action] = step
            pos[r] += 1
            placed[r].append((step, action))
        step, left = step + 1, left - len(ready)
    return placed


_Event = Tuple[Optional[_Action], List[_Message]]


def _events(placed: List[List[Tuple[int, _Action]]], rank_of: Callable[[int], int], num_stages: int,
            rank: int) -> List[_Event]:
    """What ``rank`` does, step by step: its action (if any), then the messages that other ranks
    produced for it at that step (posted for receipt right then)."""
    mine: Dict[int, _Action] = dict(placed[rank])
    incoming: Dict[int, List[_Message]] = {}
    for src, actions in enumerate(placed):
        if src == rank:
            continue
        for step, (s, kind, mb) in actions:
            dst_stage = s + 1 if kind == "F" else s - 1
            if 0 <= dst_stage < num_stages and rank_of(dst_stage) == rank:
                incoming.setdefault(step, []).append(_Message(kind, dst_stage, mb, s))
    return [(mine.get(step), incoming.get(step, [])) for step in sorted(set(mine) | set(incoming))]


def _tag(kind: str, stage: int) -> int:
    """One gloo tag per receiving stage and kind: ``F`` activations, ``B`` gradients, ``M`` shapes
    (NCCL ignores tags; there the order of the operations alone matches them)."""
    return 3 * stage + "FBM".index(kind)

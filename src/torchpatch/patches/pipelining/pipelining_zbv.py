"""pipelining-zbv: ``ScheduleZBVZeroBubble`` (torch 2.4-2.5) and ``_PipelineScheduleRuntime`` (2.4).

What breaks:   torchtitan (early 2025) imports
               ``from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime`` in
               ``distributed/pipeline.py`` and ``ScheduleZBVZeroBubble`` in its model's pipeline
               module, and its package ``__init__`` imports both: on torch 2.4 all 30 modules die with
               ``ImportError: cannot import name '_PipelineScheduleRuntime' from
               'torch.distributed.pipelining.schedules'``.
Torch:         2.4 (2.5 added ``_PipelineScheduleRuntime``, 2.6 ``ScheduleZBVZeroBubble``); 2.5 lacks
               the schedule (``ImportError: cannot import name 'ScheduleZBVZeroBubble'``), and its own
               runtime sends the activations between a rank's two V stages through the process group,
               to its own rank, which gloo refuses ("Pair is not connected"). Older torch has no
               pipelining to build on (torch 2.1-2.3 get the whole package from ``pipelining``, which
               does not serve these two). torch 2.5 is not in CI's matrix: tested on 2.5.1 by hand
               (a temporary venv) at 7c8f71b, not in CI.
Fix:           both, built on torch 2.4's own ``PipelineStage`` and ``PipelineScheduleMulti``:
               ``_PipelineScheduleRuntime`` runs per-rank lists of compute actions (``"0F1"``: stage 0
               forward of microbatch 1; ``B`` full backward, ``I`` input backward, ``W`` weight
               backward), loaded with ``_load_actions`` or ``_load_csv`` (one row per rank), for any
               placement of stages on ranks; it posts each point-to-point message itself (one tag per
               message, so no ordering between ranks can deadlock), and hands activations and
               gradients between two stages of one rank by copying them, as V placements need.
               ``ScheduleZBVZeroBubble`` (two stages per rank, V placement: rank ``r`` holds stages
               ``r`` and ``2W-1-r``) runs torch's ZB-V order. torch 2.4's stage cannot split a backward
               into input and weight gradients, so ``I`` computes both and ``W`` does nothing: the
               results are the schedule's (the same losses, outputs and gradients), its timing is not
               zero-bubble. On torch 2.5+ the runtime subclasses torch's own ``_PipelineScheduleRuntime``
               (``isinstance`` holds; its ``_load_actions`` and step are this runtime's), derives the
               stage placement from the action lists as torch does, and runs ``I``/``W`` as the stage's
               own split backward (input gradients, then weight gradients); torch's own
               ``get_schedule_class("ZBVZeroBubble")`` returns the served class. ``scale_grads=True`` (torch >= 2.7's default) divides the gradients by the
               number of microbatches after a step. Communication actions in a ``compute_comms`` action
               list (``SEND_F``, ``RECV_B``, ...) are skipped, the runtime posts its own; FSDP's
               ``UNSHARD``/``RESHARD`` raise ``NotImplementedError``.
Upstream:      https://github.com/pytorch/pytorch/pull/142084 (ZB-V schedule, torch 2.6);
               https://github.com/pytorch/pytorch/pull/130488 (_PipelineScheduleRuntime);
               https://github.com/pytorch/pytorch/pull/131762 (split dI/dW, same-rank V handoff)
"""

import csv
import re
from typing import Any, Dict, List, NamedTuple, Optional

from torchpatch import Patch, Patcher
from torchpatch.patches._reexport import reexport

PATCH = Patch(
    id="pipelining-zbv",
    summary="torch.distributed.pipelining.schedules.ScheduleZBVZeroBubble (2.4-2.5) and _PipelineScheduleRuntime "
    "(2.4; action-list runtime, V placement)",
    torch=">=2.4,<2.6",
    upstream="https://github.com/pytorch/pytorch/pull/142084",
)

SCHEDULES = "torch.distributed.pipelining.schedules"
_COMPUTE = ("F", "B", "I", "W")
_COMMS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION = re.compile(r"^(\d+)(F|B|I|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD)(\d*)$")


class _Action(NamedTuple):
    """One step of a rank's list, written like torch's: ``0F1`` is stage 0's forward of microbatch 1."""

    stage_index: int
    computation_type: str
    microbatch_index: Optional[int] = None

    def __repr__(self) -> str:
        mb = "" if self.microbatch_index is None else str(self.microbatch_index)
        return f"{self.stage_index}{self.computation_type}{mb}"

    @staticmethod
    def from_str(action: str) -> Optional["_Action"]:
        """``"0F1"`` -> the action; an empty cell -> None."""
        text = action.strip()
        if not text:
            return None
        match = _ACTION.match(text)
        if match is None:
            raise ValueError(f"invalid pipeline action {action!r}: expected e.g. '0F1', '2I0', '1W3'")
        stage, kind, mb = match.groups()
        return _Action(int(stage), kind, int(mb) if mb else None)


def zbv_order(rank: int, group_size: int, n_microbatches: int) -> List[Optional[_Action]]:
    """The ZB-V action list of ``rank`` (torch's ``ScheduleZBVZeroBubble`` order), None for idle steps."""
    n_micro = max(2 * group_size - 1, n_microbatches)
    chunk0, chunk1 = rank, 2 * group_size - 1 - rank
    ops: List[Optional[_Action]] = [None] * rank
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (group_size - rank) - 1):
        ops.append(_Action(chunk0, "F", f0))
        f0 += 1
    for _ in range(rank):
        ops += [_Action(chunk1, "F", f1), _Action(chunk0, "F", f0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(group_size - rank):
        ops += [_Action(chunk1, "F", f1), _Action(chunk1, "I", b1), _Action(chunk1, "W", b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n_micro:
        if f0 < n_micro:
            ops.append(_Action(chunk0, "F", f0))
            f0 += 1
        ops += [_Action(chunk0, "I", b0), _Action(chunk0, "W", b0)]
        ops += [_Action(chunk1, "F", f1), _Action(chunk1, "I", b1), _Action(chunk1, "W", b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [_Action(chunk0, "I", b0), _Action(chunk1, "I", b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(group_size - rank):
        ops += [_Action(chunk0, "I", b0), _Action(chunk0, "W", w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [_Action(chunk1, "W", mb) for mb in range(w1, b1)]
    ops += [_Action(chunk0, "W", mb) for mb in range(w0, b0)]
    # n_micro may exceed the microbatches there are: those steps become idle.
    return [a if a is not None and a.microbatch_index < n_microbatches else None for a in ops]


def v_placement(group_size: int, num_stages: int) -> Dict[int, int]:
    """Stage -> rank for a V: rank ``r`` holds stages ``r`` and ``2W-1-r``."""
    if num_stages != 2 * group_size:
        raise ValueError(f"ZBV needs exactly 2 stages per rank: {num_stages} stages on {group_size} ranks")
    return {s: s if s < group_size else 2 * group_size - 1 - s for s in range(num_stages)}


def _make_classes(schedules: Any) -> Dict[str, type]:
    """The two classes, on top of the installed torch's ``_PipelineScheduleRuntime`` (2.5+: its
    ``isinstance`` holds, its ``_load_actions`` and step are replaced) or ``PipelineScheduleMulti`` (2.4)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining.stage import _RecvInfo

    FWD, BWD = 0, 1

    # torch's own runtime only (vars: on 2.4 the name is served by this very factory)
    base = vars(schedules).get("_PipelineScheduleRuntime", schedules.PipelineScheduleMulti)

    class _PipelineScheduleRuntime(base):  # type: ignore[misc, valid-type]
        """Runs each rank's action list (``pipeline_order``) on its stages; see the patch's docstring."""

        def __init__(self, stages: List[Any], n_microbatches: int, loss_fn: Any = None,
                     args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                     output_merge_spec: Any = None, scale_grads: bool = True) -> None:
            super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                             output_merge_spec)
            self.scale_grads = scale_grads
            self.stage_index_to_group_rank: Dict[int, int] = dict(stages[0].stage_index_to_group_rank)
            self.pipeline_order: Dict[int, List[Optional[_Action]]] = {}

        def _load_actions(self, actions: Dict[int, List[Optional[_Action]]], format: str = "compute_only") -> None:
            """Take ``actions`` (rank -> its list; torch's own actions or ours) as the schedule, each stage
            placed on the rank whose list runs it; communication actions are skipped."""
            if format not in ("compute_only", "compute_comms"):
                raise NotImplementedError(f"{format=} is not implemented")
            order: Dict[int, List[Optional[_Action]]] = {}
            for rank, raw in actions.items():
                ops = [None if a is None else _Action.from_str(str(a)) for a in raw]
                for a in ops:
                    if a is not None and a.computation_type not in _COMPUTE + _COMMS:
                        raise NotImplementedError(
                            f"torchpatch (pipelining-zbv): action {a} ({a.computation_type}) is not supported on "
                            f"torch 2.4: only F, B, I, W (and SEND/RECV, which the runtime posts itself)")
                order[rank] = [a if a is None or a.computation_type in _COMPUTE else None for a in ops]
            self._place(order)
            self._validate(order)
            self.pipeline_order = order

        def _place(self, order: Dict[int, List[Optional[_Action]]]) -> None:
            """Stage -> rank from the ranks' lists (as torch >= 2.5 derives it), on this schedule and its stages."""
            placement = dict(self.stage_index_to_group_rank)
            runs: Dict[int, int] = {}
            for rank, ops in order.items():
                for a in ops:
                    if a is not None and runs.setdefault(a.stage_index, rank) != rank:
                        raise ValueError(f"stage {a.stage_index} has actions on ranks {runs[a.stage_index]} and {rank}")
            placement.update(runs)
            for stage in self._stages:
                if placement[stage.stage_index] != stage.group_rank:
                    raise ValueError(f"stage {stage.stage_index} is built on rank {stage.group_rank}, but the "
                                     f"schedule runs it on rank {placement[stage.stage_index]}")
                stage.stage_index_to_group_rank = placement
            self.stage_index_to_group_rank = placement

        def _load_csv(self, filename: str, format: str = "compute_only") -> None:
            """Load the schedule from a CSV file: row ``r`` is rank ``r``'s actions, one per cell."""
            with open(filename, newline="") as f:
                rows = list(csv.reader(f))
            self._load_actions({rank: [_Action.from_str(cell) for cell in row] for rank, row in enumerate(rows)},
                               format)

        def _validate(self, order: Dict[int, List[Optional[_Action]]]) -> None:
            """Every stage runs forward and backward once per microbatch."""
            n = self._n_microbatches
            seen: List[tuple] = []  # (stage, "F" or "B", microbatch) of every action
            for ops in order.values():
                for a in ops:
                    if a is None:
                        continue
                    kind = "B" if a.computation_type in ("B", "I") else a.computation_type
                    seen.append((a.stage_index, kind, a.microbatch_index))
            for stage in range(self._num_stages):
                for kind in ("F", "B") if self._has_backward else ("F",):
                    got = sorted(mb for s, k, mb in seen if s == stage and k == kind)
                    if got != list(range(n)):
                        raise ValueError(f"the schedule must run stage {stage}'s {kind} once for each of the "
                                         f"{n} microbatches, got microbatches {got}")

        # -- one step ----------------------------------------------------------------------
        def _peer(self, stage: Any, other: int) -> int:
            rank = self.stage_index_to_group_rank[other]
            return rank if stage.group is None else dist.get_global_rank(stage.group, rank)

        def _tag(self, direction: int, sender: int, mb: int, k: int) -> int:
            return ((direction * self._num_stages + sender) * self._n_microbatches + mb) * 64 + k

        def _recv(self, stage: Any, infos: Any, direction: int, mb: int) -> None:
            """Receive ``infos``' buffers from stages on other ranks (same-rank ones were copied in)."""
            works, count = [], {}
            for info in infos:
                if not isinstance(info, _RecvInfo):
                    continue
                k = count[info.source] = count.get(info.source, -1) + 1
                if self.stage_index_to_group_rank[info.source] != self.rank:
                    works.append(dist.irecv(info.buffer, self._peer(stage, info.source), stage.group,
                                            self._tag(direction, info.source, mb, k)))
            for w in works:
                w.wait()

        def _send(self, stage: Any, items: List[tuple], direction: int, mb: int, local: Dict[int, Any],
                  pending: List[tuple]) -> None:
            """Send ``(tensor, destination stage)`` pairs; to a stage of this rank, copy into ``local[dst]``,
            that stage's receive infos for ``mb``."""
            count: Dict[int, int] = {}
            for tensor, dst in items:
                k = count[dst] = count.get(dst, -1) + 1
                if self.stage_index_to_group_rank[dst] == self.rank:
                    infos = [i for i in local[dst] if isinstance(i, _RecvInfo) and i.source == stage.stage_index]
                    with torch.no_grad():
                        infos[k].buffer.copy_(tensor)
                else:
                    data = tensor.detach().contiguous()
                    pending.append((data, dist.isend(data, self._peer(stage, dst), stage.group,
                                                     self._tag(direction, stage.stage_index, mb, k))))

        def _step_microbatches(self, arg_mbs: Optional[List] = None, kwarg_mbs: Optional[List] = None,
                               target_mbs: Optional[List] = None, losses: Optional[List] = None) -> None:
            if not self.pipeline_order:
                raise RuntimeError("torchpatch (pipelining-zbv): no schedule loaded: call _load_csv or _load_actions")
            arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
            if not getattr(self, "_stages_initialized", True):  # torch >= 2.6 sizes stages at the first step
                self._initialize_stages(arg_mbs[0], kwarg_mbs[0])
            stages = {s.stage_index: s for s in self._stages}
            pending: List[tuple] = []
            for action in self.pipeline_order.get(self.rank, []):
                if action is None:
                    continue
                stage, mb = stages[action.stage_index], action.microbatch_index
                split = hasattr(stage, "backward_weight_one_chunk")  # torch 2.4's stage cannot split a backward
                if action.computation_type == "W":
                    if split:
                        stage.backward_weight_one_chunk(mb)
                    continue
                if action.computation_type == "F":
                    if not stage.is_first:
                        infos = stage.args_recv_info[mb]
                        if self._has_backward:
                            for info in infos:
                                if isinstance(info, _RecvInfo):
                                    info.buffer.requires_grad_(True)
                        self._recv(stage, infos, FWD, mb)
                    output = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb])
                    self._maybe_compute_loss(stage, output, target_mbs, mb)
                    if not stage.is_last:
                        outs = output if type(output) is tuple else (output,)
                        items = [(out, dst) for idx, out in enumerate(outs)
                                 for dst in stage.act_send_info[idx] if dst is not None]
                        self._send(stage, items, FWD, mb,
                                   {d: stages[d].args_recv_info[mb] for _, d in items if d in stages}, pending)
                else:  # "B", or "I": the input part (the whole backward on torch 2.4)
                    if not stage.is_last:
                        self._recv(stage, stage.grad_recv_info[mb], BWD, mb)
                    input_only = {"full_backward": False} if split and action.computation_type == "I" else {}
                    stage.backward_one_chunk(mb, loss=self._maybe_get_loss(stage, mb), **input_only)
                    if not stage.is_first:
                        if stage.grad_send_info is None:
                            stage.grad_send_info = stage._create_grad_send_info(stage.args_recv_info[0])
                        # the input gradients: torch 2.4-2.5 keep the last in grads_input, later torch per microbatch
                        grads = stage.bwd_cache.pop(mb) if hasattr(stage, "bwd_cache") else stage.grads_input
                        items = [(g, dst) for g, dst in zip(grads, stage.grad_send_info)
                                 if isinstance(g, torch.Tensor) and dst is not None]
                        self._send(stage, items, BWD, mb,
                                   {d: stages[d].grad_recv_info[mb] for _, d in items if d in stages}, pending)
            for _data, work in pending:
                work.wait()
            if self.scale_grads and self._has_backward:
                for stage in self._stages:
                    for p in stage.submod.parameters():
                        if p.grad is not None:
                            p.grad.div_(self._n_microbatches)
            self._update_losses(self._stages, losses)

    class ScheduleZBVZeroBubble(_PipelineScheduleRuntime):
        """The Zero Bubble V schedule (https://arxiv.org/pdf/2401.10241, section 6): two stages per
        rank in a V. On torch 2.4 its I steps run the whole backward and W steps nothing."""

        def __init__(self, stages: List[Any], n_microbatches: int, loss_fn: Any = None,
                     args_chunk_spec: Any = None, kwargs_chunk_spec: Any = None,
                     output_merge_spec: Any = None, scale_grads: bool = True) -> None:
            if len(stages) != 2:
                raise ValueError(f"ZBV requires exactly 2 stages per rank, but got {len(stages)}.")
            group_size = stages[0].group_size
            placement = v_placement(group_size, stages[0].num_stages)
            for stage in stages:
                if placement[stage.stage_index] != stage.group_rank:
                    raise ValueError(
                        f"ZBV places stage {stage.stage_index} on rank {placement[stage.stage_index]} (rank r holds "
                        f"stages r and {2 * group_size - 1}-r), but it was built on rank {stage.group_rank}")
                stage.stage_index_to_group_rank = dict(placement)
            super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                             output_merge_spec, scale_grads)
            self._load_actions({r: zbv_order(r, group_size, n_microbatches) for r in range(group_size)})

    return {"_PipelineScheduleRuntime": _PipelineScheduleRuntime, "ScheduleZBVZeroBubble": ScheduleZBVZeroBubble}


_classes: Dict[str, type] = {}


def runtime_classes() -> Dict[str, type]:
    """``_PipelineScheduleRuntime`` and ``ScheduleZBVZeroBubble`` of this patch, made once for the installed
    torch (``pipelining-dualpipev`` builds on the runtime)."""
    if not _classes:
        import torch.distributed.pipelining.schedules as schedules

        _classes.update(_make_classes(schedules))
    return _classes


def _served(name: str) -> Any:
    return lambda: runtime_classes()[name]


def serve_in_lookup(patcher: Patcher, schedules: Any, lookup_name: str, class_name: str) -> bool:
    """Where torch has its own ``get_schedule_class`` (2.5+), make it return the served ``class_name`` for
    ``lookup_name`` (any case) instead of its "Unknown schedule name" ``ValueError``; on 2.4,
    ``pipelining-schedules`` serves a lookup that finds it already."""
    if "get_schedule_class" not in vars(schedules):
        return False

    def lookup(wrapped: Any, _instance: Any, args: tuple, kwargs: Dict[str, Any]) -> Any:
        try:
            return wrapped(*args, **kwargs)
        except ValueError:
            name = kwargs.get("schedule_name", args[0] if args else None)
            if not (isinstance(name, str) and name.lower() == lookup_name.lower()):
                raise
            return getattr(schedules, class_name)

    patcher.wrap(schedules, "get_schedule_class", lookup)
    return True


for _name in ("_PipelineScheduleRuntime", "ScheduleZBVZeroBubble"):
    PATCH.symbol(SCHEDULES, _name)(_served(_name))


@PATCH.on_import(SCHEDULES)
def zbv_in_lookup(patcher: Patcher, schedules: Any) -> bool:
    return serve_in_lookup(patcher, schedules, "ZBVZeroBubble", "ScheduleZBVZeroBubble")

# torch 2.15's torch.distributed.pipelining re-exports it
PATCH.symbol("torch.distributed.pipelining", "ScheduleZBVZeroBubble")(reexport(SCHEDULES, "ScheduleZBVZeroBubble"))

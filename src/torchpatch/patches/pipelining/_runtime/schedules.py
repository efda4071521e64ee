"""The schedules: ``_PipelineSchedule`` runs a step (microbatches, the rank's actions in the
timeline's order, their point-to-point messages) and holds the arguments every schedule takes;
its subclasses say in which order each rank runs its actions, and check what is particular to
them: GPipe and 1F1B (one stage per rank), Looped BFS and Interleaved 1F1B (several)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from .microbatch import TensorChunkSpec, _shard, merge_chunks, split_args_kwargs_into_chunks
from .stage import _PREFIX, PipelineStage, Tensors, _TensorMeta, _decode, _encode
from .timeline import _Action, _Event, _Message, _events, _tag, _timeline


class _PipelineSchedule(ABC):
    """Runs a step: splits the batch into microbatches, runs the rank's actions in the timeline's
    order with their point-to-point messages, returns the last stage's merged output.

    ``scale_grads`` (torch >= 2.7's argument, default True as there): after the step, divide each
    stage's gradients by the number of microbatches, which makes them those of the mean of the
    microbatch losses; False keeps their sum (torch 2.4-2.6 behaviour).
    """

    def __init__(
        self,
        stages: List[PipelineStage],
        n_microbatches: int,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        args_chunk_spec: Optional[Tuple[Any, ...]] = None,
        kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
        output_merge_spec: Optional[Any] = None,
        scale_grads: bool = True,
    ) -> None:
        stages = self._arrange_stages(stages)
        if not stages:
            raise ValueError("a pipeline schedule needs at least one stage")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be positive, got {n_microbatches}")
        first = stages[0]
        for stage in stages:
            if (stage.num_stages, stage.group, stage.group_rank) != (first.num_stages, first.group, first.group_rank):
                raise ValueError(f"{_PREFIX}: the stages {stages} of one schedule must share num_stages and group")
        self._stages = list(stages)
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self._args_chunk_spec = args_chunk_spec
        self._kwargs_chunk_spec = kwargs_chunk_spec
        self._output_merge_spec = output_merge_spec
        self.scale_grads = scale_grads
        self._has_backward = loss_fn is not None
        self._num_stages = first.num_stages
        self.pp_group_size = first.group_size
        self.rank = first.group_rank
        self._internal_losses: Dict[int, torch.Tensor] = {}
        self._events_cache: Dict[bool, List[_Event]] = {}
        self._token = object()  # marks the stages' learnt shapes and buffers as this schedule's
        self._met = False  # the ranks met once (a barrier) before the first point-to-point message
        self._init_schedule()

    # -- what subclasses define ---------------------------------------------------------------------
    def _arrange_stages(self, stages: List[PipelineStage]) -> List[PipelineStage]:
        """The given stages in the order the schedule keeps them (as given, here)."""
        return stages

    def _init_schedule(self) -> None:
        """Check and set up what is particular to the schedule, once the common state is set."""

    @abstractmethod
    def _rank_order(self, rank: int) -> List[_Action]:
        """Every compute action of ``rank``, forwards and full backwards, in the order it runs them."""

    # -- the timeline -------------------------------------------------------------------------------
    def _orders(self, backward: bool) -> List[List[_Action]]:
        orders = [self._rank_order(r) for r in range(self.pp_group_size)]
        return orders if backward else [[a for a in o if a.computation_type == "F"] for o in orders]

    @property
    def pipeline_order(self) -> Dict[int, List[Optional[_Action]]]:
        """Each rank's actions by time step (None: idle), as this runtime places them."""
        placed = _timeline(self._orders(self._has_backward), self._num_stages)
        length = max((s for actions in placed for s, _ in actions), default=-1) + 1
        table: Dict[int, List[Optional[_Action]]] = {r: [None] * length for r in range(self.pp_group_size)}
        for r, actions in enumerate(placed):
            for step, action in actions:
                table[r][step] = action
        return table

    def _events(self) -> List[_Event]:
        if self._has_backward not in self._events_cache:
            placed = _timeline(self._orders(self._has_backward), self._num_stages)
            rank_of = self._stages[0].stage_index_to_group_rank.__getitem__
            self._events_cache[self._has_backward] = _events(placed, rank_of, self._num_stages, self.rank)
        return self._events_cache[self._has_backward]

    # -- step -----------------------------------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: Optional[List[Any]] = None,
             return_outputs: bool = True, loss_kwargs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> Any:
        """One iteration on a whole batch: the first stage's rank passes the batch (``args``,
        ``kwargs``), the last stage's rank the ``target`` for ``loss_fn``; every rank calls it.
        ``losses``, on the last stage's rank, receives the per-microbatch losses. Returns the
        merged output on the last stage's rank (None elsewhere, or with ``return_outputs=False``)."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() requires gradients to be enabled for backward computation; it should "
                               "not be used under torch.no_grad() context. Please call eval() instead.")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"losses must be a list but got a {type(losses)}")
        last = next((s for s in self._stages if s.is_last), None)
        if last is not None and self._has_backward and target is None:
            raise ValueError(f"{_PREFIX}: step() on the rank of the last stage needs target= for loss_fn")
        for stage in self._stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
        target_mbs = None
        if target is not None and last is not None:
            target_mbs = [chunk["target"] for chunk in _shard({"target": target}, {"target": TensorChunkSpec(0)},
                                                              self._n_microbatches)]
            self._check_count(target_mbs, "target microbatches")
        self._run(arg_mbs, kwarg_mbs, target_mbs, return_outputs, loss_kwargs or {})
        self._update_losses(losses, last is not None)
        if last is not None and return_outputs:
            return merge_chunks(last.output_chunks, self._output_merge_spec)
        return None

    def eval(self, *args: Any, target: Any = None, losses: Optional[List[Any]] = None, **kwargs: Any) -> Any:
        """``step`` with forwards only (losses are computed where ``target`` is given)."""
        has_backward = self._has_backward
        self._has_backward = False
        try:
            return self.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._has_backward = has_backward

    def _check_count(self, chunks: List[Any], what: str) -> None:
        if len(chunks) != self._n_microbatches:
            raise ValueError(f"Expecting {self._n_microbatches} {what} but got {len(chunks)}")

    def _split_inputs(self, args: Tuple[Any, ...],
                      kwargs: Dict[str, Any]) -> Tuple[List[Tuple[Any, ...]], List[Dict[str, Any]]]:
        if not args and not kwargs:
            return [()] * self._n_microbatches, [{}] * self._n_microbatches
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, self._n_microbatches,
                                                           self._args_chunk_spec, self._kwargs_chunk_spec)
        self._check_count(arg_mbs, "arg_mbs")
        return arg_mbs, kwarg_mbs

    def _update_losses(self, losses: Optional[List[Any]], has_last: bool) -> None:
        internal, self._internal_losses = self._internal_losses, {}
        if has_last and losses is not None and internal:
            losses.clear()
            losses.extend(internal[mb] for mb in range(self._n_microbatches))

    # -- the runtime ----------------------------------------------------------------------------------
    def _run(self, arg_mbs: List[Tuple[Any, ...]], kwarg_mbs: List[Dict[str, Any]], target_mbs: Optional[List[Any]],
             return_outputs: bool, loss_kwargs: Dict[str, Any]) -> None:
        stages = {s.stage_index: s for s in self._stages}
        n = self._n_microbatches
        learnt = (self._token, self._has_backward)
        # First step, a switch between train and eval, or another schedule used these stages since:
        # learn the shapes again (every rank decides alike, running the same steps in the same order).
        if any(stage._learnt_for != learnt for stage in self._stages):
            for stage in self._stages:
                stage._reset_buffers()
                stage._learnt_for = learnt
            meta_to_send: Set[int] = {s for s in stages if s + 1 < self._num_stages and s + 1 not in stages}
        else:
            meta_to_send = set()
        if not self._met and self.pp_group_size > 1:
            # NCCL wants every rank in a group's first call; it also checks that all ranks are here.
            group, device = self._stages[0].group, self._stages[0].device
            nccl = dist.get_backend(group) == "nccl" and device.index is not None
            dist.barrier(group=group, device_ids=[device.index] if nccl else None)
            self._met = True
        pending: Dict[Tuple[str, int, int], List[Any]] = {}  # message -> its receive works
        sends: List[Tuple[Any, _Message, Tensors]] = []  # work, message, tensors kept alive until sent

        for action, incoming in self._events():
            ops: List[dist.P2POp] = []
            posts: List[Tuple[Optional[Tuple[str, int, int]], _Message, Tensors]] = []  # per op
            if action is not None:
                s, kind, mb = action
                stage = stages[s]
                if kind == "F":
                    if not stage.is_first and s - 1 not in stages:
                        self._wait(pending.pop(("F", s, mb)), stage, "activations", mb, s - 1)
                    output = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb], save_forward_output=return_outputs)
                    if stage.is_last and self._loss_fn is not None and target_mbs is not None:
                        self._internal_losses[mb] = self._loss(stage, output, target_mbs[mb], mb, loss_kwargs)
                    if not stage.is_last:
                        if s + 1 in stages:
                            stages[s + 1]._set_local_input(mb, stage.fwd_cache[mb][0], n)
                        else:
                            tensors = stage._outputs_to_send(mb)
                            peer = stage._global_rank(s + 1)
                            if s in meta_to_send:
                                meta_to_send.discard(s)
                                sends += self._send_meta(stage, peer, s + 1)
                            msg = _Message("F", s + 1, mb, s)
                            for t in tensors:
                                ops.append(dist.P2POp(dist.isend, t, peer, stage.group, _tag("F", s + 1)))
                                posts.append((None, msg, tensors))
                else:
                    if not stage.is_last and s + 1 not in stages:
                        self._wait(pending.pop(("B", s, mb)), stage, "gradients", mb, s + 1)
                    stage.backward_one_chunk(mb, loss=self._internal_losses.get(mb) if stage.is_last else None)
                    if not stage.is_first:
                        grads = stage.bwd_cache.pop(mb)
                        if s - 1 in stages:
                            stages[s - 1]._set_local_grads(mb, grads)
                        else:
                            peer = stage._global_rank(s - 1)
                            msg = _Message("B", s - 1, mb, s)
                            grads = tuple(g.contiguous() for g in grads)
                            for g in grads:
                                ops.append(dist.P2POp(dist.isend, g, peer, stage.group, _tag("B", s - 1)))
                                posts.append((None, msg, grads))
            for msg in incoming:
                stage = stages[msg.stage]
                peer = stage._global_rank(msg.src_stage)
                if msg.kind == "F":
                    if stage._input_metas is None:
                        stage._set_input_metas(self._recv_meta(stage, peer, msg), n)
                    buffers = stage._recv_act_buffers(msg.mb)
                else:
                    buffers = stage._recv_grad_buffers(msg.mb)
                key = (msg.kind, msg.stage, msg.mb)
                pending[key] = []
                for b in buffers:
                    ops.append(dist.P2POp(dist.irecv, b, peer, stage.group, _tag(msg.kind, msg.stage)))
                    posts.append((key, msg, buffers))
            if ops:
                for work, (key, msg, tensors) in zip(dist.batch_isend_irecv(ops), posts):
                    if key is None:
                        sends.append((work, msg, tensors))
                    else:
                        pending[key].append(work)

        for work, msg, _tensors in sends:
            src = stages[msg.src_stage]
            what = "activations" if msg.kind == "F" else "gradients"
            self._wait([work], src, what, msg.mb, msg.stage, sending=True)
        if self._has_backward and self.scale_grads:
            for stage in self._stages:
                stage.scale_grads(n)

    def _loss(self, stage: PipelineStage, output: Any, target: Any, mb: int,
              loss_kwargs: Dict[str, Any]) -> torch.Tensor:
        assert self._loss_fn is not None
        try:
            return self._loss_fn(output, target, **loss_kwargs)
        except Exception as exc:
            raise RuntimeError(f"{_PREFIX}: loss_fn failed on the output of stage {stage.stage_index} (rank "
                               f"{stage.group_rank}) for microbatch {mb}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _wait(works: List[Any], stage: PipelineStage, what: str, mb: int, peer_stage: int,
              sending: bool = False) -> None:
        try:
            for work in works:
                work.wait()
        except Exception as exc:
            verb, prep = ("send", "to") if sending else ("receive", "from")
            raise RuntimeError(
                f"{_PREFIX}: stage {stage.stage_index} (rank {stage.group_rank}) could not {verb} the {what} of "
                f"microbatch {mb} {prep} stage {peer_stage} (rank {stage.stage_index_to_group_rank[peer_stage]}): "
                f"{type(exc).__name__}: {exc}. Another rank of the pipeline failed or stopped (see its "
                "error), or the process group's timeout ran out.") from exc

    @staticmethod
    def _send_meta(stage: PipelineStage, peer: int, dst_stage: int) -> List[Tuple[Any, _Message, Tensors]]:
        """Send the shapes of ``stage``'s outputs ahead of its first activation (length, then values)."""
        assert stage._output_metas is not None
        values = torch.tensor(_encode(stage._output_metas), dtype=torch.int64, device=stage.device)
        length = torch.tensor([values.numel()], dtype=torch.int64, device=stage.device)
        msg = _Message("F", dst_stage, 0, stage.stage_index)
        tag = _tag("M", dst_stage)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, length, peer, stage.group, tag)])
        works += dist.batch_isend_irecv([dist.P2POp(dist.isend, values, peer, stage.group, tag)])
        return [(w, msg, (length, values)) for w in works]

    def _recv_meta(self, stage: PipelineStage, peer: int, msg: _Message) -> Tuple[_TensorMeta, ...]:
        tag = _tag("M", msg.stage)
        length = torch.zeros(1, dtype=torch.int64, device=stage.device)
        self._wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, length, peer, stage.group, tag)]),
                   stage, "activation shapes", msg.mb, msg.src_stage)
        values = torch.zeros(int(length.item()), dtype=torch.int64, device=stage.device)
        self._wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, values, peer, stage.group, tag)]),
                   stage, "activation shapes", msg.mb, msg.src_stage)
        return _decode(values.tolist())


class PipelineScheduleSingle(_PipelineSchedule):
    """Base class of the schedules with one stage per rank (``num_stages`` equal to the pipeline
    group's size, stage ``i`` on rank ``i``)."""

    def __init__(
        self,
        stage: PipelineStage,
        n_microbatches: int,
        loss_fn: Optional[Callable[..., torch.Tensor]] = None,
        args_chunk_spec: Optional[Tuple[Any, ...]] = None,
        kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
        output_merge_spec: Optional[Any] = None,
        scale_grads: bool = True,
    ) -> None:
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__} takes one PipelineStage; for several stages per rank use "
                            f"ScheduleInterleaved1F1B or ScheduleLoopedBFS (got {type(stage).__name__})")
        if stage.num_stages != stage.group_size:
            raise ValueError(f"{type(self).__name__} runs one stage per rank, but there are {stage.num_stages} "
                             f"stages on {stage.group_size} ranks; use ScheduleInterleaved1F1B or ScheduleLoopedBFS")
        super().__init__([stage], n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads)
        self._stage = stage


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards (fill-drain)."""

    def _rank_order(self, rank: int) -> List[_Action]:
        n = self._n_microbatches
        return [_Action(rank, "F", mb) for mb in range(n)] + [_Action(rank, "B", mb) for mb in range(n)]


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: ``num_stages - stage_index`` warm-up forwards, then one backward and one forward in
    turn, then the remaining backwards."""

    def _init_schedule(self) -> None:
        if self._n_microbatches < self._num_stages:
            raise ValueError(f"Number of microbatches ({self._n_microbatches}) must be greater than or equal to the "
                             f"number of stages ({self._num_stages}).")

    def _rank_order(self, rank: int) -> List[_Action]:
        n = self._n_microbatches
        warmup = min(n, self._num_stages - rank)
        order = [_Action(rank, "F", mb) for mb in range(warmup)]
        for k in range(n - warmup):
            order += [_Action(rank, "B", k), _Action(rank, "F", warmup + k)]
        return order + [_Action(rank, "B", mb) for mb in range(n - warmup, n)]


class PipelineScheduleMulti(_PipelineSchedule):
    """Base class of the schedules with several stages per rank: rank ``r`` of ``W`` holds stages
    ``r, r + W, r + 2W, ...`` (all of them), ``num_stages`` a multiple of ``W``."""

    def _arrange_stages(self, stages: List[PipelineStage]) -> List[PipelineStage]:
        return sorted(stages, key=lambda s: s.stage_index)

    def _init_schedule(self) -> None:
        W = self.pp_group_size
        expected = list(range(self.rank, self._num_stages, W))
        if self._num_stages % W or [s.stage_index for s in self._stages] != expected:
            raise ValueError(
                f"{type(self).__name__}: rank {self.rank} of {W} must hold stages {expected} of "
                f"{self._num_stages} (stage i on rank i % {W}, the same number on every rank); it was given "
                f"{[s.stage_index for s in self._stages]}")
        self.n_local_stages = len(self._stages)


class ScheduleLoopedBFS(PipelineScheduleMulti):
    """Breadth-first: each local stage forwards every microbatch in turn (earlier stages first),
    then the backwards run in the reverse order."""

    def _rank_order(self, rank: int) -> List[_Action]:
        n, W = self._n_microbatches, self.pp_group_size
        local = list(range(rank, self._num_stages, W))
        order = [_Action(s, "F", mb) for s in local for mb in range(n)]
        return order + [_Action(s, "B", mb) for s in reversed(local) for mb in reversed(range(n))]


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B (https://arxiv.org/pdf/2104.04473), depth first: microbatches go through
    the local stages in rounds of ``n_microbatches // rounds``, ``rounds = max(1, n_microbatches //
    group size)``, which must divide ``n_microbatches`` (torch >= 2.5's relaxed condition)."""

    def _init_schedule(self) -> None:
        super()._init_schedule()
        n_microbatches = self._n_microbatches
        self.number_of_rounds = max(1, n_microbatches // self.pp_group_size)
        self.microbatches_per_round = n_microbatches // self.number_of_rounds
        if n_microbatches % self.number_of_rounds:
            raise ValueError("Interleaved 1F1B requires the number of microbatches to be a multiple of the "
                             f"number of rounds ({self.number_of_rounds}), but got {n_microbatches}.")

    def _rank_order(self, rank: int) -> List[_Action]:
        n, W, L, per_round = self._n_microbatches, self.pp_group_size, self.n_local_stages, self.microbatches_per_round
        total = n * L
        warmup = min((L - 1) * per_round + 2 * (W - 1 - rank), total)
        next_mb: Dict[Tuple[str, int], int] = {}

        def take(kind: str, local: int) -> _Action:
            stage = local * W + rank
            mb = next_mb.get((kind, stage), 0)
            next_mb[(kind, stage)] = mb + 1
            return _Action(stage, kind, mb)

        def forward(k: int) -> _Action:
            return take("F", (k // per_round) % L)

        def backward(k: int) -> _Action:
            return take("B", L - 1 - ((k - warmup) // per_round) % L)

        order = [forward(k) for k in range(warmup)]
        for k in range(warmup, total):
            order += [forward(k), backward(k)]
        return order + [backward(k) for k in range(total, total + warmup)]

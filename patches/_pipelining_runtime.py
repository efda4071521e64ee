"""The pipeline runtime behind the ``pipelining`` patch: ``torch.distributed.pipelining`` (manual
stages, GPipe / 1F1B / Interleaved 1F1B / Looped BFS schedules, microbatch split and merge) for a
torch that lacks it. Not a patch (the leading underscore): it imports torch, and is imported only
when the served package is, or directly (``benchmarks/pipelining.py`` runs it on a newer torch).

How a step runs. Every schedule is, per rank, an ordered list of compute actions (forward ``F`` or
full backward ``B`` of one stage on one microbatch). All ranks derive the same global timeline from
those lists: each action is placed at the first time step after its inputs were produced (an
activation from the previous stage, a gradient from the next). A message produced at step ``t``
is sent, and posted for receipt on its destination rank, in that rank's batch for step ``t``
(``batch_isend_irecv``), so every pair of ranks issues its point-to-point operations in the same
order on both sides (what NCCL needs; gloo also gets one tag per stage and direction). A rank only
blocks where a compute action needs a message that has not arrived. Shapes are learnt at the first
step: the first activation a stage sends carries its tensor metadata, from which the next stage
sizes its receive buffers (one per microbatch, reused at every step, as in torch).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

Tensors = Tuple[torch.Tensor, ...]
_PREFIX = "torchpatch pipelining"

# -- microbatch: split a batch into microbatches, merge the outputs -------------------------------
DEFAULT_CHUNK_DIM = 0


class TensorChunkSpec:
    """How to split a tensor argument into microbatches: along ``split_dim``."""

    def __init__(self, split_dim: int) -> None:
        self.split_dim = split_dim

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self.split_dim})"

    def __str__(self) -> str:
        return f"TensorChunkSpec({self.split_dim})"

    @staticmethod
    def from_tuple(chunk_dims: Tuple[int, ...]) -> Any:
        """``TensorChunkSpec`` for each (nested) dimension of ``chunk_dims``, positional arguments."""
        leaves, spec = tree_flatten(chunk_dims)
        return tree_unflatten([TensorChunkSpec(d) for d in leaves], spec)

    @staticmethod
    def from_dict(chunk_dims: Dict[str, int]) -> Any:
        """``TensorChunkSpec`` for each (nested) dimension of ``chunk_dims``, keyword arguments."""
        leaves, spec = tree_flatten(chunk_dims)
        return tree_unflatten([TensorChunkSpec(d) for d in leaves], spec)


class _Replicate:
    """Chunk-spec marker (the class itself): the value goes whole into every microbatch."""


class _CustomReducer:
    """Merge spec: reduce the microbatches' values with ``reduce_fn`` from ``init_value``."""

    def __init__(self, init_value: Any, reduce_fn: Callable[[Any, Any], Any]) -> None:
        self.init_value = init_value
        self.reduce_fn = reduce_fn


class _LossReducer(_CustomReducer):
    pass


sum_reducer = _LossReducer(torch.tensor(0.0), lambda a, b: a + b)


def _shard(values: Dict[Any, Any], specs: Dict[Any, Any], chunks: int) -> List[Dict[Any, Any]]:
    """Split each value (a pytree) by its spec into ``chunks`` dicts. As in torch, the first tensor
    with fewer than ``chunks`` rows along its dimension lowers the count (with a warning), a later
    one raises; non-tensors and ``_Replicate`` leaves are replicated."""
    if set(values) != set(specs):
        raise ValueError(f"arguments {list(values)} and chunk specs {list(specs)} do not match")
    count, first_tensor = chunks, True
    split: Dict[Any, Tuple[Any, List[Any]]] = {}  # key -> (treespec, per leaf: chunks or a value)
    for key, value in values.items():
        leaves, treespec = tree_flatten(value)
        spec_leaves, _ = tree_flatten(specs[key])
        if len(leaves) != len(spec_leaves):
            raise ValueError(f"Argument value {value} did not have the same number of values as chunk spec "
                             f"{specs[key]}")
        parts: List[Any] = []
        for leaf, spec in zip(leaves, spec_leaves):
            if spec is _Replicate or not isinstance(leaf, torch.Tensor):
                parts.append(_Replicate)
                continue
            if not isinstance(spec, TensorChunkSpec):
                raise TypeError(f"Unrecognized chunk spec: {spec}")
            size = leaf.size(spec.split_dim)
            if size < count:
                if not first_tensor:
                    raise RuntimeError(
                        f"Arg {key} on chunking dimension has a size of {size}, smaller than the number of "
                        f"chunks {count}; other arguments have more rows. Adjust the number of microbatches.")
                logger.warning("Tensor size on chunking dimension is %s, downsizing the number of chunks "
                               "from %s to %s.", size, count, size)
                count = size
            parts.append(torch.tensor_split(leaf, count, spec.split_dim))
            first_tensor = False
        split[key] = (treespec, [(leaf, part) for leaf, part in zip(leaves, parts)])
    return [
        {key: tree_unflatten([leaf if part is _Replicate else part[i] for leaf, part in pairs], treespec)
         for key, (treespec, pairs) in split.items()}
        for i in range(count)
    ]


def split_args_kwargs_into_chunks(
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    chunks: int,
    args_chunk_spec: Optional[Tuple[Any, ...]] = None,
    kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
) -> Tuple[List[Tuple[Any, ...]], List[Dict[str, Any]]]:
    """Split positional and keyword arguments into ``chunks`` microbatches (dimension 0 unless
    the specs say otherwise); returns the list of args tuples and the list of kwargs dicts."""
    kwargs = kwargs or {}
    if args_chunk_spec is None:
        args_chunk_spec = (TensorChunkSpec(DEFAULT_CHUNK_DIM),) * len(args)
    if kwargs_chunk_spec is None:
        kwargs_chunk_spec = dict.fromkeys(kwargs, TensorChunkSpec(DEFAULT_CHUNK_DIM))
    args_split = _shard(dict(enumerate(args)), dict(enumerate(args_chunk_spec)), chunks)
    kwargs_split = _shard(kwargs, kwargs_chunk_spec, len(args_split))
    if len(kwargs_split) < len(args_split):
        args_split = _shard(dict(enumerate(args)), dict(enumerate(args_chunk_spec)), len(kwargs_split))
    if len(args_split) != len(kwargs_split):
        raise RuntimeError("args and kwargs are split into different number of chunks: "
                           f"{len(args_split)}, {len(kwargs_split)}")
    return [tuple(chunk[i] for i in range(len(args))) for chunk in args_split], kwargs_split


def merge_chunks(chunks: List[Any], chunk_spec: Any) -> Any:
    """Merge microbatch values into one: ``TensorChunkSpec`` leaves are concatenated, reducers
    reduce, other leaves must be equal in every chunk (``chunk_spec`` None: concatenate along 0)."""
    if chunk_spec is not None:
        spec_leaves, treespec = tree_flatten(chunk_spec)
    else:
        first, treespec = tree_flatten(chunks[0])
        spec_leaves = [TensorChunkSpec(DEFAULT_CHUNK_DIM)] * len(first)
    flat = []
    for chunk in chunks:
        leaves, _ = tree_flatten(chunk)
        if len(leaves) != len(spec_leaves):
            raise ValueError(f"Chunk {chunk} did not match chunk spec {chunk_spec}")
        flat.append(leaves)
    merged = []
    for i, spec in enumerate(spec_leaves):
        column = [leaves[i] for leaves in flat]
        if isinstance(spec, TensorChunkSpec):
            merged.append(torch.cat(column, dim=spec.split_dim))
        elif isinstance(spec, _CustomReducer):
            value = spec.init_value
            for item in column:
                value = spec.reduce_fn(value, item)
            merged.append(value)
        else:
            if any(item != column[0] for item in column[1:]):
                raise ValueError(f"values {column} differ between microbatches but are not merged by a chunk spec")
            merged.append(column[0])
    return tree_unflatten(merged, treespec)


# -- tensor metadata sent with a stage's first activation ------------------------------------------
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


class _TensorMeta(NamedTuple):
    shape: Tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "_TensorMeta":
        return cls(tuple(t.shape), t.dtype, bool(t.requires_grad))

    def describe(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).replace('torch.', '')}"


def _encode(metas: Sequence[_TensorMeta]) -> List[int]:
    out = [len(metas)]
    for meta in metas:
        if meta.dtype not in _DTYPES:
            raise TypeError(f"{_PREFIX}: activations of dtype {meta.dtype} cannot be sent between stages")
        out += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape), *meta.shape]
    return out


def _decode(values: List[int]) -> Tuple[_TensorMeta, ...]:
    metas, pos = [], 1
    for _ in range(values[0]):
        dtype, requires_grad, ndim = values[pos:pos + 3]
        metas.append(_TensorMeta(tuple(values[pos + 3:pos + 3 + ndim]), _DTYPES[dtype], bool(requires_grad)))
        pos += 3 + ndim
    return tuple(metas)


def _expected_metas(args: Any, name: str) -> Optional[Tuple[_TensorMeta, ...]]:
    if args is None:
        return None
    tensors = args if isinstance(args, (tuple, list)) else (args,)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"PipelineStage({name}=...) takes a tensor or a tuple of tensors, got {args!r}")
    return tuple(_TensorMeta.of(t) for t in tensors)


def _shapes_differ(expected: Sequence[_TensorMeta], actual: Sequence[_TensorMeta]) -> bool:
    return [(m.shape, m.dtype) for m in expected] != [(m.shape, m.dtype) for m in actual]


def _describe(metas: Sequence[_TensorMeta]) -> str:
    return "(" + ", ".join(m.describe() for m in metas) + ")"


# -- stages ------------------------------------------------------------------------------------------
class PipelineStage:
    """One stage of a pipeline, built by hand: ``submodule`` runs stage ``stage_index`` of
    ``num_stages`` on ``device``; stage ``i`` lives on rank ``i % group size`` of ``group`` (the
    default group if None). ``input_args`` / ``output_args`` (example microbatch tensors, as torch
    2.4 takes them) are optional: the shapes are learnt at the first step and checked against them.
    A stage module's outputs, except the last stage's, must be a tensor or a tuple/list of tensors.
    """

    def __init__(
        self,
        submodule: nn.Module,
        stage_index: int,
        num_stages: int,
        device: Union[torch.device, str, int],
        input_args: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None,
        output_args: Union[torch.Tensor, Tuple[torch.Tensor, ...], None] = None,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        if isinstance(submodule, nn.parallel.DistributedDataParallel):
            raise NotImplementedError(
                f"{_PREFIX}: a DistributedDataParallel-wrapped stage module is not supported (its "
                "gradient reduction expects one backward per forward; a pipeline runs several "
                "microbatches). Wrap the plain module and all-reduce its gradients after step().")
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"Stage index {stage_index} is out of range of {num_stages}")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group
        self.group_rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        if self.group_size > num_stages:
            raise RuntimeError(f"Pipeline group size {self.group_size} cannot be larger than number of stages "
                               f"{num_stages}")
        self.stage_index_to_group_rank = {i: i % self.group_size for i in range(num_stages)}
        self._global_ranks: Dict[int, int] = {}
        if self.stage_index_to_group_rank[stage_index] != self.group_rank:
            raise ValueError(
                f"Stage {stage_index} of {num_stages} belongs on pipeline rank {stage_index % self.group_size} "
                f"(stage i on rank i % {self.group_size}), not on rank {self.group_rank}")
        self._expected_inputs = _expected_metas(input_args, "input_args")
        self._expected_outputs = _expected_metas(output_args, "output_args")
        self.has_backward = False
        self.output_chunks: List[Any] = []
        self.fwd_cache: Dict[int, Tuple[Tensors, Tensors]] = {}  # mb -> (outputs, received inputs)
        self.bwd_cache: Dict[int, Tensors] = {}  # mb -> gradients of the received inputs, to send back
        self._reset_buffers()

    # -- identity -----------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _global_rank(self, stage_index: int) -> int:
        """The global rank that holds ``stage_index`` (what torch 2.1's P2P calls take)."""
        if stage_index not in self._global_ranks:
            group_rank = self.stage_index_to_group_rank[stage_index]
            self._global_ranks[stage_index] = (
                group_rank if self.group is None else dist.get_global_rank(self.group, group_rank))
        return self._global_ranks[stage_index]

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index} of {self.num_stages}, rank {self.group_rank}, {self.device})"

    # -- buffers ------------------------------------------------------------------------------------
    def _reset_buffers(self) -> None:
        """Forget learnt shapes and buffers (a new schedule, or a switch between train and eval)."""
        self._input_metas: Optional[Tuple[_TensorMeta, ...]] = None
        self._output_metas: Optional[Tuple[_TensorMeta, ...]] = None
        self._learnt_for: Optional[Tuple[object, bool]] = None  # (schedule token, has_backward)
        self._act_buffers: Dict[int, Tensors] = {}  # mb -> received activations (autograd leaves)
        self._grad_buffers: Dict[int, Tuple[Optional[torch.Tensor], ...]] = {}  # mb -> output grads

    def _set_input_metas(self, metas: Tuple[_TensorMeta, ...], n_microbatches: int) -> None:
        """Shapes of this stage's inputs, learnt from the previous stage; receive buffers for them
        (none where the previous stage runs on this rank: its outputs are taken as they are)."""
        if self._expected_inputs is not None and _shapes_differ(self._expected_inputs, metas):
            raise ValueError(
                f"{_PREFIX}: stage {self.stage_index} receives {_describe(metas)} from stage "
                f"{self.stage_index - 1}, but PipelineStage(input_args=...) says {_describe(self._expected_inputs)}")
        self._input_metas = metas
        if self.stage_index_to_group_rank[self.stage_index - 1] != self.group_rank:
            self._act_buffers = {
                mb: tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas)
                for mb in range(n_microbatches)
            }

    def _recv_act_buffers(self, mb: int) -> Tensors:
        return self._act_buffers[mb]

    def _recv_grad_buffers(self, mb: int) -> Tensors:
        """Buffers for the gradients of this stage's outputs that require grad (from the next stage)."""
        if mb not in self._grad_buffers:
            assert self._output_metas is not None  # the forward of ``mb`` ran before its backward
            self._grad_buffers[mb] = tuple(
                torch.empty(m.shape, dtype=m.dtype, device=self.device) if m.requires_grad else None
                for m in self._output_metas)
        return tuple(b for b in self._grad_buffers[mb] if b is not None)

    def _set_local_input(self, mb: int, outputs: Tensors, n_microbatches: int) -> None:
        """The previous stage runs on this rank: take its outputs as this stage's inputs."""
        if self._input_metas is None:
            self._set_input_metas(tuple(_TensorMeta.of(t) for t in outputs), n_microbatches)
        self._act_buffers[mb] = tuple(t.detach() for t in outputs)

    def _set_local_grads(self, mb: int, grads: Tensors) -> None:
        """The next stage runs on this rank: its input gradients are this stage's output gradients."""
        assert self._output_metas is not None
        it = iter(grads)
        self._grad_buffers[mb] = tuple(next(it) if m.requires_grad else None for m in self._output_metas)

    # -- compute ------------------------------------------------------------------------------------
    def forward_one_chunk(self, mb: int, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None,
                          save_forward_output: bool = True) -> Any:
        """Run the stage module on microbatch ``mb``: ``args`` for the first stage, the received
        activations for the others, plus ``kwargs`` (every stage's own)."""
        if self.is_first:
            inputs: Tuple[Any, ...] = tuple(args)
            received: Tensors = ()
        else:
            metas = self._input_metas
            assert metas is not None
            grad = self.has_backward and torch.is_grad_enabled()
            received = tuple(b.requires_grad_(grad and m.requires_grad and (b.is_floating_point() or b.is_complex()))
                             for b, m in zip(self._act_buffers[mb], metas))
            inputs = received
        try:
            output = self.submod(*inputs, **(kwargs or {}))
        except Exception as exc:
            raise RuntimeError(f"{_PREFIX}: stage {self.stage_index} (rank {self.group_rank}) failed in the "
                               f"forward of microbatch {mb}: {type(exc).__name__}: {exc}") from exc
        outputs = self._outputs_as_tuple(output)
        if self.is_last and save_forward_output:
            self.output_chunks.append(output)
        if self._output_metas is None and not self.is_last:
            self._output_metas = tuple(_TensorMeta.of(t) for t in outputs)
            if self._expected_outputs is not None and _shapes_differ(self._expected_outputs, self._output_metas):
                raise ValueError(
                    f"{_PREFIX}: stage {self.stage_index} outputs {_describe(self._output_metas)}, but "
                    f"PipelineStage(output_args=...) says {_describe(self._expected_outputs)}")
        self.fwd_cache[mb] = (outputs, received)
        return output

    def _outputs_as_tuple(self, output: Any) -> Tensors:
        if isinstance(output, torch.Tensor):
            return (output,)
        if self.is_last:
            return tuple(t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor))
        if isinstance(output, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in output):
            return tuple(output)
        raise TypeError(f"{_PREFIX}: stage {self.stage_index} returned {type(output).__name__}; a stage "
                        "other than the last must return a tensor or a tuple/list of tensors")

    def _outputs_to_send(self, mb: int) -> Tensors:
        outputs = self.fwd_cache[mb][0]
        assert self._output_metas is not None
        actual = tuple(_TensorMeta.of(t) for t in outputs)
        if _shapes_differ(self._output_metas, actual):
            raise ValueError(
                f"{_PREFIX}: stage {self.stage_index} outputs {_describe(actual)} for microbatch {mb} but "
                f"{_describe(self._output_metas)} for the first one; the receive buffers are sized once, at "
                "the first step (as in torch): every microbatch of every step must have the same shapes")
        return tuple(t.detach().contiguous() for t in outputs)

    def backward_one_chunk(self, mb: int, loss: Optional[torch.Tensor] = None) -> None:
        """Backward of microbatch ``mb``: from ``loss`` on the last stage, from the received output
        gradients elsewhere. Parameter gradients accumulate; the received inputs' gradients are
        kept in ``bwd_cache`` for the previous stage."""
        if not self.has_backward:
            return
        outputs, received = self.fwd_cache.pop(mb)
        if self.is_last:
            if loss is None:
                raise RuntimeError(f"{_PREFIX}: the last stage needs a loss to run a backward (give the "
                                   "schedule a loss_fn)")
            roots, grads = [loss], [None]
        else:
            it = iter(self._grad_buffers[mb])
            pairs = [(t, g) for t, g in zip(outputs, it) if g is not None and t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        try:
            if roots:
                torch.autograd.backward(roots, grad_tensors=grads)
        except Exception as exc:
            raise RuntimeError(f"{_PREFIX}: stage {self.stage_index} (rank {self.group_rank}) failed in the "
                               f"backward of microbatch {mb}: {type(exc).__name__}: {exc}") from exc
        if not self.is_first:
            input_grads = []
            for t in received:
                if t.requires_grad:
                    input_grads.append(t.grad if t.grad is not None else torch.zeros_like(t))
                    t.grad = None
            self.bwd_cache[mb] = tuple(input_grads)
        if self.is_last and not self.is_first:
            for t in outputs:  # only returned to the user now: let the graph go
                if not t._is_view():
                    t.detach_()

    def scale_grads(self, grad_scale_factor: int) -> None:
        """Divide the stage module's gradients by ``grad_scale_factor`` (the number of microbatches
        for a loss that averages, 1 for one that sums)."""
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None:
                    p.grad.div_(grad_scale_factor)

    def clear_runtime_states(self) -> None:
        """Drop what one step kept (cached activations, outputs, gradients to send)."""
        self.fwd_cache.clear()
        self.bwd_cache.clear()
        self.output_chunks.clear()
        for buffers in self._act_buffers.values():
            for b in buffers:
                b.grad = None


def _needs_export(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} splits a model by tracing it with torch.export (export with the pipe_split marker, "
        f"then unflatten; torch 2.4), which torch {torch.__version__} does not have. torchpatch's "
        "backport of torch.distributed.pipelining runs manually split models: build each stage's "
        "nn.Module yourself and wrap it in PipelineStage(submodule, stage_index, num_stages, device), "
        "then pass the stage(s) to a schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B).")


def pipeline(module: nn.Module, mb_args: Any, mb_kwargs: Any = None, split_spec: Any = None,
             split_policy: Any = None) -> Any:
    """Tracer-based splitting (torch 2.4): not available here, raises."""
    raise _needs_export("pipeline()")


def pipe_split() -> None:
    """Split marker for tracer-based splitting (torch 2.4): not available here, raises."""
    raise _needs_export("pipe_split()")


def build_stage(stage_module: nn.Module, stage_index: int, pipe_info: Any, device: Any, group: Any = None) -> Any:
    """Stage from a traced ``Pipe`` (torch 2.4): not available here, raises."""
    raise _needs_export("build_stage()")


class Pipe:
    """A traced, split model (torch 2.4's ``pipeline()`` result): not available here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _needs_export("Pipe")


class _SplitPointType(type):
    def __getattr__(cls, name: str) -> Any:
        if name in ("BEGINNING", "END"):
            raise _needs_export(f"SplitPoint.{name}")
        raise AttributeError(f"type object 'SplitPoint' has no attribute {name!r}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise _needs_export("SplitPoint")


class SplitPoint(metaclass=_SplitPointType):
    """Where ``pipeline()`` splits (torch 2.4's enum ``BEGINNING``/``END``): the members raise, as
    they only mean something to ``pipeline()``, which needs torch.export."""


# -- schedules ---------------------------------------------------------------------------------------
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

    # -- what subclasses define ---------------------------------------------------------------------
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

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                 args_chunk_spec: Optional[Tuple[Any, ...]] = None, kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
                 output_merge_spec: Optional[Any] = None, scale_grads: bool = True) -> None:
        super().__init__(stage, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        if n_microbatches < self._num_stages:
            raise ValueError(f"Number of microbatches ({n_microbatches}) must be greater than or equal to the "
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
        stages = sorted(stages, key=lambda s: s.stage_index)
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec,
                         output_merge_spec, scale_grads)
        W = self.pp_group_size
        expected = list(range(self.rank, self._num_stages, W))
        if self._num_stages % W or [s.stage_index for s in stages] != expected:
            raise ValueError(
                f"{type(self).__name__}: rank {self.rank} of {W} must hold stages {expected} of "
                f"{self._num_stages} (stage i on rank i % {W}, the same number on every rank); it was given "
                f"{[s.stage_index for s in stages]}")
        self.n_local_stages = len(stages)


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

    def __init__(self, stages: List[PipelineStage], n_microbatches: int,
                 loss_fn: Optional[Callable[..., torch.Tensor]] = None,
                 args_chunk_spec: Optional[Tuple[Any, ...]] = None, kwargs_chunk_spec: Optional[Dict[str, Any]] = None,
                 output_merge_spec: Optional[Any] = None, scale_grads: bool = True) -> None:
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
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

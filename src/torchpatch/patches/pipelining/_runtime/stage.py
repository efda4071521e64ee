"""The stage: ``PipelineStage`` (one stage's module on its rank: forward and backward of a
microbatch, the buffers its messages are received into), the tensor metadata its first activation
carries, and the stand-ins of torch 2.4's tracer-based splitting (``pipeline``, ``pipe_split``,
``build_stage``, ``Pipe``, ``SplitPoint``), which raise."""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

Tensors = Tuple[torch.Tensor, ...]
_PREFIX = "torchpatch pipelining"

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

"""fsdp2-cpu: FSDP2 (``fully_shard``) on a machine without CUDA, on torch 2.4.

What breaks:   on a CPU-only machine, the first forward of a ``fully_shard`` model dies in
               ``torch.cuda.Stream(priority=...)`` (``RuntimeError: ... no NVIDIA driver`` on CUDA
               builds, ``AssertionError: Torch not compiled with CUDA enabled`` on CPU builds): torch
               2.4's FSDP2 creates CUDA streams and events unconditionally, so it cannot run on CPU
               with gloo at all (CI machines, laptops, torchtitan's CPU tests). Behind that, the
               first backward of a parameter resharded after forward dies with ``RuntimeError: one
               of the variables needed for gradient computation has been modified by an inplace
               operation``: FSDP2's all-gather copy-out (``torch.split_with_sizes_copy(..., out=)``)
               leaves the version counters of its outputs alone on CUDA but bumps them on CPU
               (pytorch#132014), and 2.4's FSDP2 relies on the CUDA behaviour. Behind that, for
               fp32/bf16 gradients FSDP2 averages with the collectives' AVG op, which 2.4's gloo
               lacks (2.9's has it): HSDP's all-reduce dies with ``RuntimeError: Cannot use
               ReduceOp.AVG with Gloo``, and gloo's ``reduce_scatter_tensor`` silently *sums*, so
               the gradients come out data-parallel-size times too large (AdamW all but hides it).
Torch:         2.4 (the matrix's; 2.5 has the same code). 2.6 takes streams and events from the
               mesh device's handle (pytorch#136843), and torch.cpu's stream gained the no-op
               ``wait_event``/``record_event`` FSDP2 calls in 2.7 (pytorch#145935); 2.5 and 2.6 are
               outside the matrix and not covered.
Fix:           while ``torch.cuda.is_available()`` is false, FSDP2's modules see ``torch.cuda``
               as a CPU handle: ``Stream`` (``wait_stream``, ``wait_event``, ``record_event``),
               ``Event`` (``record``, ``wait``, ``synchronize``, ``query``), ``current_stream``
               and ``stream`` — all immediate, as torch >= 2.7's CPU handle, since CPU kernels run in
               program order on the calling thread; and ``torch.split_with_sizes_copy`` into CPU
               tensors keeps the version counters of ``out`` as the CUDA kernel does (torch >= 2.6
               wraps that copy in ``_unsafe_preserve_version_counter`` itself). The modules' other
               uses of ``torch`` are untouched; with CUDA available nothing changes. On a gloo
               reduce-scatter group, FSDP2's gradient division takes its sum-then-divide path
               (reduce with SUM, then divide the result by the data-parallel size, the path 2.4
               itself takes for fp16), which is what an AVG reduction computes.
Upstream:      https://github.com/pytorch/pytorch/pull/136843 (FSDP2's device handle);
               https://github.com/pytorch/pytorch/pull/145935 (CPU stream events)
"""

import contextlib
import types
from typing import Any, Dict, Iterator, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="fsdp2-cpu",
    summary="FSDP2 on CPU/gloo on torch 2.4 (CPU streams and events, copy-out keeps version counters, no gloo AVG)",
    torch=">=2.4,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/136843",
    behaviour="fully_shard on a machine without CUDA",
)

# FSDP2's modules that call torch.cuda's stream API at run time.
MODULES = (
    "torch.distributed._composable.fsdp._fsdp_collectives",
    "torch.distributed._composable.fsdp._fsdp_param_group",
    "torch.distributed._composable.fsdp._fsdp_state",
)


class Event:
    """A CPU event: work before it has already run when it is recorded."""

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Stream:
    """A CPU stream: the calling thread's program order."""

    def __init__(self, priority: int = 0) -> None:
        self.priority = priority

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Optional[Event] = None) -> Event:
        return event or Event()


_CURRENT = Stream()


@contextlib.contextmanager
def _stream(stream: Optional[Stream]) -> Iterator[None]:
    yield


CPU_HANDLE = types.SimpleNamespace(Stream=Stream, Event=Event, current_stream=lambda device=None: _CURRENT, stream=_stream)


def _split_with_sizes_copy(torch: types.ModuleType) -> Any:
    """``torch.split_with_sizes_copy`` that leaves the version counters of CPU ``out`` tensors as
    they were, as the CUDA kernel does."""

    def split_with_sizes_copy(*args: Any, out: Any, **kwargs: Any) -> Any:
        versions = [(t, t._version) for t in out if t.device.type == "cpu"]
        result = torch.split_with_sizes_copy(*args, out=out, **kwargs)
        for tensor, version in versions:
            torch._C._autograd._unsafe_set_version_counter(tensor, version)
        return result

    return split_with_sizes_copy


class _TorchForFSDP(types.ModuleType):
    """``torch`` as FSDP2's modules see it while CUDA is unavailable: ``torch.cuda`` is the CPU
    handle, ``torch.split_with_sizes_copy`` keeps CPU version counters."""

    def __init__(self, torch: types.ModuleType) -> None:
        super().__init__("torch")
        self._torch = torch
        self._split_with_sizes_copy = _split_with_sizes_copy(torch)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._torch, name)
        if self._torch.cuda.is_available():
            return value
        if name == "cuda":
            return CPU_HANDLE
        if name == "split_with_sizes_copy":
            return self._split_with_sizes_copy
        return value


def _divide_factors(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """FSDP2's gradient divide factors: on a gloo reduce-scatter group, never AVG (None, None) but
    SUM then a division by the data-parallel size."""
    factors = wrapped(*args, **kwargs)
    group = args[0] if args else kwargs["reduce_scatter_group"]
    all_reduce_group = args[1] if len(args) > 1 else kwargs.get("all_reduce_group")
    if factors != (None, None) or _backend(group) != "gloo":
        return factors
    size = group.size() * (all_reduce_group.size() if all_reduce_group is not None else 1)
    return 1.0, float(size)


def _backend(group: Any) -> str:
    import torch.distributed as dist

    return str(dist.get_backend(group))


@PATCH.on_import("torch.distributed._composable.fsdp._fsdp_collectives")
def sum_then_divide_on_gloo(patcher: Patcher, module: types.ModuleType) -> bool:
    import inspect

    if list(inspect.signature(module._get_gradient_divide_factors).parameters) != [
            "reduce_scatter_group", "all_reduce_group", "reduce_dtype"]:
        return False  # a later FSDP2, which picks its reduce ops itself
    patcher.wrap(module, "_get_gradient_divide_factors", _divide_factors)
    return True


def _swap_torch(patcher: Patcher, module: types.ModuleType) -> bool:
    import torch

    if getattr(module, "torch", None) is not torch:
        return False  # not the module this patch was written for
    patcher.setattr(module, "torch", _TorchForFSDP(torch))
    return True


for _module in MODULES:
    PATCH.on_import(_module)(_swap_torch)

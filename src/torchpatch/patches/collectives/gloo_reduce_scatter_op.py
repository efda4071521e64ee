"""gloo-reduce-scatter-op: gloo's reduce-scatter ignores its reduce op and sums, torch 2.2-2.7.

What breaks:   on a gloo group, every tensor reduce-scatter reduces with SUM whatever op it is
               given, silently: ``dist.reduce_scatter_tensor(out, x, op=ReduceOp.MAX)``,
               ``funcol.reduce_scatter_tensor(x, "max", 0, group)`` and so DTensor's
               ``Partial("max").redistribute(mesh, [Shard(0)])`` hand back the sum of the ranks'
               values (2 ranks holding 1.0 and 4.0: 5.0, where the max is 4.0); MIN, PRODUCT and
               the bitwise ops likewise (ints 6 and 5: BAND gives 11); AVG (``Partial("avg")`` to
               ``Shard``, FSDP2's gradient reduce-scatter) gives the sum, group-size times too
               large, where gloo's all-reduce would raise ``Cannot use ReduceOp.AVG with Gloo``;
               PREMUL_SUM drops its factor (where gloo's all-reduce raises ``Cannot use
               ReduceOp.PREMUL_SUM with Gloo``).
Torch:         ``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` (which ``_reduce_scatter_base``
               calls) simulates the collective by an all-reduce of a copy and keeps this rank's
               chunk; it fills ``AllreduceOptions`` with the op, then calls ``allreduce(inp)``
               without them. That code came with pytorch#118911 (Feb. 2024: torch 2.3), and
               pytorch#149869 (opened 2025-03-24) is the change that passes the options. Run here:
               2.4.1 sums; 2.9.0, 2.13.0, 2.14.1 and 2.15.0 reduce right; 2.1.2 is right (gloo had
               no tensor reduce-scatter: ``dist.reduce_scatter_tensor`` raises, funcol falls back
               to an all-reduce with the op). Not run (no such torch here): 2.3, 2.5 and 2.6
               (released before #149869: the bug, by source), 2.7 (released 2025-04: whether it took #149869
               the sources here do not tell) and 2.2 (gloo's earlier fallback of pytorch#112144,
               all-reduce + scatter, whose source was not found). So the specifier spans 2.2-2.7
               and the fix decides by behaviour, lazily: the first reduce-scatter with an op other than
               SUM on a gloo group asks, once per process, a one-rank gloo group (loopback, no peer)
               to reduce-scatter a float tensor with ``ReduceOp.BAND``, which gloo's all-reduce
               refuses for floats; on a torch that passes the op it raises, and every call goes to
               torch's own code. A job that never reduce-scatters with such an op never asks.
Fix:           on a group whose backend for the tensor's device is gloo, a reduce-scatter with an
               op other than SUM is done as the fixed torch does it: an all-reduce of a copy of
               the input with the op, this rank's chunk copied out (``ProcessGroup.
               _reduce_scatter_base`` and ``reduce_scatter_tensor_coalesced``, so
               ``dist.reduce_scatter_tensor`` also in a coalescing manager; and
               ``funcol.reduce_scatter_tensor``/``reduce_scatter_tensor_coalesced``, whose native
               op calls the group from C++). AVG is a SUM divided by the group's size, as gloo's
               AVG (torch >= 2.7) computes it; integer outputs of AVG raise on the cast back,
               funcol's give a float average. Calls done this way wait before they
               return (``async_op=True`` gets a finished work). SUM and other backends are
               torch's own; code traced into a graph that calls ``torch.ops._c10d_functional``
               directly is not covered.
Upstream:      https://github.com/pytorch/pytorch/pull/149869 (passes the options to the
               all-reduce); the bug came with https://github.com/pytorch/pytorch/pull/118911
"""

import inspect
from typing import Any, Dict, List, Optional, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="gloo-reduce-scatter-op",
    summary="reduce-scatter on gloo honours MAX/MIN/PRODUCT/AVG/... instead of summing",
    torch=">=2.2,<2.8",
    upstream="https://github.com/pytorch/pytorch/pull/149869",
    behaviour="reduce_scatter_tensor with an op other than SUM on gloo (c10d, funcol, DTensor Partial -> Shard)",
    category="correctness",
)

_probe: Optional[bool] = None


def gloo_ignores_reduce_scatter_op() -> bool:
    """Whether this torch's gloo reduce-scatter drops its op: asked once of a one-rank gloo group
    (no peer, loopback device), with an op gloo's all-reduce refuses for a float tensor."""
    global _probe
    if _probe is None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_gloo_available():
            _probe = False
            return _probe
        from torch._C._distributed_c10d import HashStore, ProcessGroupGloo, ReduceOp, ReduceScatterOptions

        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._threads = 1
        group = ProcessGroupGloo(HashStore(), 0, 1, options)
        opts = ReduceScatterOptions()
        opts.reduceOp = ReduceOp.BAND
        try:
            group._reduce_scatter_base(torch.empty(1), torch.ones(1), opts).wait()
            _probe = True  # a bitwise AND of floats went through: the op never reached gloo
        except RuntimeError:
            _probe = False  # "Cannot use ReduceOp.BAND with non-integral dtype": the op is honoured
    return _probe


def _is_gloo(group: Any, tensor: Any) -> bool:
    """Whether ``group`` reduces ``tensor`` with gloo (its backend for the tensor's device)."""
    try:
        backend = group._get_backend(tensor.device)
    except (RuntimeError, AttributeError):
        return False
    return type(backend).__name__ == "ProcessGroupGloo"


def _kind(op: Any) -> Any:
    """The ``RedOpType`` of a ``ReduceOp`` (or of a ``RedOpType`` itself)."""
    return getattr(op, "op", op)


def _fits(group: Any, output: Any, input: Any) -> bool:
    """Whether gloo's shape and dtype checks would pass: else torch's own call raises them."""
    size = group.size()
    return (output.dtype == input.dtype and output.dim() == input.dim() >= 1
            and output.size(0) * size == input.size(0) and output.shape[1:] == input.shape[1:])


def _reduce_scatter(group: Any, outputs: List[Any], inputs: List[Any], opts: Any) -> Any:
    """Reduce-scatter as pytorch#149869's gloo does: all-reduce a copy with the op (AVG: SUM,
    then a division by the group's size, as gloo's AVG of torch >= 2.7), keep this rank's chunk of
    dimension 0. Waits; returns the last all-reduce's work, finished. (Not a work of gloo's
    reduce-scatter: waiting on that one again copies its chunk out again.)"""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import AllreduceOptions

    average = _kind(opts.reduceOp) == dist.ReduceOp.AVG
    work = None
    for output, input in zip(outputs, inputs):
        buffer = input.clone(memory_format=torch.contiguous_format)
        ar_opts = AllreduceOptions()
        ar_opts.reduceOp = dist.ReduceOp.SUM if average else opts.reduceOp
        ar_opts.timeout = opts.timeout
        work = group.allreduce([buffer], ar_opts)
        work.wait()
        output.copy_(buffer.chunk(group.size())[group.rank()])
        if average:
            output.div_(group.size())
    return work


def _needs_fix(group: Any, outputs: List[Any], inputs: List[Any], opts: Any) -> bool:
    import torch.distributed as dist

    return (bool(inputs) and len(outputs) == len(inputs) and _kind(opts.reduceOp) != dist.ReduceOp.SUM
            and _is_gloo(group, inputs[0]) and all(_fits(group, o, i) for o, i in zip(outputs, inputs))
            and gloo_ignores_reduce_scatter_op())


def _bind(instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any], names: Tuple[str, str]) -> Tuple[Any, Any, Any, Any]:
    """(group, outputs, inputs, opts) of a ``ProcessGroup`` method call, bound or not (opts None
    where the call leaves them out: the default, a SUM, which needs no fix)."""
    group, rest = (instance, args) if instance is not None else (args[0], args[1:])
    values = dict(zip((*names, "opts"), rest))
    values.update(kwargs)
    return group, values.get(names[0]), values.get(names[1]), values.get("opts")


def _reduce_scatter_base(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    group, output, input, opts = _bind(instance, args, kwargs, ("outputTensor", "inputTensor"))
    if opts is None or output is None or input is None or not _needs_fix(group, [output], [input], opts):
        return wrapped(*args, **kwargs)
    return _reduce_scatter(group, [output], [input], opts)


def _reduce_scatter_coalesced(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    group, outputs, inputs, opts = _bind(instance, args, kwargs, ("outputTensors", "inputTensors"))
    if opts is None or outputs is None or inputs is None or not _needs_fix(group, list(outputs), list(inputs), opts):
        return wrapped(*args, **kwargs)
    return _reduce_scatter(group, list(outputs), list(inputs), opts)


def _as_collective_result(funcol: Any, tensor: Any) -> Any:
    """``tensor`` as funcol returns a result: an ``AsyncCollectiveTensor`` in eager mode."""
    tracing = getattr(funcol, "_are_we_tracing", lambda: False)()
    wrap = getattr(funcol, "_maybe_wrap_tensor", None)
    return wrap(tensor) if wrap is not None and not tracing else tensor


def _funcol_group(funcol: Any, group: Any, tag: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(funcol._resolve_group_name(group, tag))


_signatures: Dict[Any, inspect.Signature] = {}  # funcol's functions, read once


def _arguments(wrapped: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    signature = _signatures.get(wrapped)
    if signature is None:
        signature = _signatures[wrapped] = inspect.signature(wrapped)
    return signature.bind(*args, **kwargs).arguments


def _op_argument(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> str:
    """``reduceOp``, funcol's second parameter, lower-cased: the sum (the common case) is left to torch
    before anything else is looked at."""
    return str(args[1] if len(args) > 1 else kwargs.get("reduceOp", "")).lower()


def _funcol_reduce_scatter(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    op = _op_argument(args, kwargs)
    if op == "sum":
        return wrapped(*args, **kwargs)
    a = _arguments(wrapped, args, kwargs)
    op = str(a["reduceOp"]).lower()
    import torch
    import torch.distributed._functional_collectives as funcol

    x, dim, group, tag = a["self"], a["scatter_dim"], a["group"], a.get("tag", "")
    pg = _funcol_group(funcol, group, tag)
    if not _is_gloo(pg, x) or x.dim() == 0 or x.size(dim) % pg.size() != 0 or not gloo_ignores_reduce_scatter_op():
        return wrapped(*args, **kwargs)  # another backend, torch's own assertion on the size, or a fixed gloo
    if op == "avg":
        return _as_collective_result(funcol, wrapped(x, "sum", dim, group, tag) / pg.size())
    reduced = funcol.all_reduce(x, op, group, tag)
    mine = torch.chunk(reduced, pg.size(), dim=dim)[pg.rank()].clone(memory_format=torch.contiguous_format)
    return _as_collective_result(funcol, mine)


def _funcol_reduce_scatter_coalesced(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    if _op_argument(args, kwargs) == "sum":
        return wrapped(*args, **kwargs)
    a = _arguments(wrapped, args, kwargs)
    inputs, op, dims, group, tag = a["inputs"], a["reduceOp"], a["scatter_dim"], a["group"], a.get("tag", "")
    if str(op).lower() == "sum" or not inputs or len(dims) != len(inputs):
        return wrapped(*args, **kwargs)
    import torch.distributed._functional_collectives as funcol

    if not _is_gloo(_funcol_group(funcol, group, tag), inputs[0]) or not gloo_ignores_reduce_scatter_op():
        return wrapped(*args, **kwargs)
    return [funcol.reduce_scatter_tensor(x, op, d, group, tag) for x, d in zip(inputs, dims)]


@PATCH.on_import("torch.distributed")
def reduce_with_the_op(patcher: Patcher, dist: Any) -> bool:
    if not dist.is_available() or not dist.is_gloo_available():
        return False
    from torch._C._distributed_c10d import ProcessGroup

    patcher.wrap(ProcessGroup, "_reduce_scatter_base", _reduce_scatter_base)
    patcher.wrap(ProcessGroup, "reduce_scatter_tensor_coalesced", _reduce_scatter_coalesced)
    return True


@PATCH.on_import("torch.distributed._functional_collectives")
def funcol_reduce_with_the_op(patcher: Patcher, funcol: Any) -> bool:
    if not hasattr(funcol, "_resolve_group_name"):
        return False  # torch 2.1's module: gloo has no tensor reduce-scatter there
    patcher.wrap(funcol, "reduce_scatter_tensor", _funcol_reduce_scatter)
    patcher.wrap(funcol, "reduce_scatter_tensor_coalesced", _funcol_reduce_scatter_coalesced)
    return True

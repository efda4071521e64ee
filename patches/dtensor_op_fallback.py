"""dtensor-op-fallback: an op with no DTensor sharding strategy runs on replicated inputs instead
of failing; ``register_sharding`` where torch lacks it.

What breaks:   a vendor or custom op (``torch.library``) called with DTensors fails with
               ``NotImplementedError: Operator mylib.fused_attn.default does not have a sharding
               strategy registered.`` On torch 2.4 there is not even a public way to register one
               (``torch.distributed.tensor.experimental.register_sharding`` came with 2.5).
Torch:         2.4-2.13 (every torch whose DTensor has ``register_op_strategy``).
Fix:           the first time an op fails that way, a sharding strategy is registered for it that
               takes every tensor input as ``Replicate()`` and gives every output ``Replicate()``:
               DTensor then gathers the inputs itself (an all-gather per sharded input, on every
               call), runs the op on the local tensors and wraps the outputs. An output whose shape
               equals a DTensor input's global shape is then resharded like that input (the first
               such input; a local slice, no communication). One warning per op names it and shows
               how to register a real strategy with ``register_sharding``. Ops that mutate their
               inputs are left failing: replicating a sharded input they write to would be wrong.
               ``register_sharding`` itself is served on torch 2.4 (under
               ``torch.distributed._tensor.experimental``, which ``dtensor-experimental`` also serves
               as ``torch.distributed.tensor.experimental``), with torch 2.5's semantics.
               Under torch's ``context_parallel`` with load balancing (the default on 2.5+) the
               sequence shards are reordered, which a gather-and-run cannot know: the fallback
               raises there instead of attending over the reordered sequence. That is the case of
               SDPA on CPU, whose kernel context_parallel does not implement (CUDA kernels only).
Pitfalls:      the fallback is correct but not fast: every sharded input is gathered on every
               call. The warning is the reminder to register a strategy.
Upstream:      https://github.com/pytorch/pytorch/pull/131108 (register_sharding, torch 2.5)
"""

import functools
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._dtensor import DISPATCH_MODULES, dtensor_type, placement_types

PATCH = Patch(
    id="dtensor-op-fallback",
    summary="ops without a DTensor sharding strategy run on replicated inputs (one warning per op); "
    "register_sharding on torch 2.4",
    torch=">=2.4",
    upstream="https://github.com/pytorch/pytorch/pull/131108",
    behaviour="DTensor ops without a sharding strategy gather their inputs and run",
)

_NO_STRATEGY = "does not have a sharding strategy registered"
_fallen_back: Set[Any] = set()  # ops given the replicate-everything strategy by this patch

_WARNING = (
    "torchpatch (dtensor-op-fallback): {op} has no DTensor sharding strategy; it now runs on "
    "replicated inputs (every sharded input is all-gathered on each call) and its outputs are "
    "resharded like the input of the same shape. Register a strategy to shard it for real:\n"
    "    from torch.distributed.tensor import Replicate, Shard\n"
    "    from torch.distributed.tensor.experimental import register_sharding\n"
    "    @register_sharding(torch.ops.{qualname})\n"
    "    def {fn}_sharding({params}):\n"
    "        # a list of (output placements, input placements), one placement per tensor, None for others\n"
    "        return [({outs}, {ins})]"
)


def register_sharding(op: Any) -> Callable[[Callable[..., Sequence[Tuple[List[Any], List[Any]]]]], Any]:
    """torch 2.5's ``register_sharding`` for torch 2.4: decorate a function that takes the op's
    arguments (tensors as DTensor specs) and returns acceptable ``(output placements, input
    placements)`` pairs for one mesh dimension; ``None`` stands for a non-tensor argument."""
    from torch.distributed._tensor.api import DTensor
    from torch.distributed._tensor.ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed._tensor.placement_types import DTensorSpec

    def strategy(sharding_fn: Callable[..., Any], mesh: Any, op_schema: Any) -> Any:
        specs = [a.strategies[0].output_spec if hasattr(a, "strategies") else a for a in op_schema.args_schema]
        kwspecs = {k: v.strategies[0].output_spec if hasattr(v, "strategies") else v
                   for k, v in op_schema.kwargs_schema.items()}
        single_dim = []
        for outputs, inputs in sharding_fn(*specs, **kwspecs):
            # torch 2.4's expansion takes placements for tensor inputs only.
            tensor_inputs = [p for p, a in zip(inputs, specs) if isinstance(a, DTensorSpec)]
            single_dim.append(list(outputs) + tensor_inputs)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, single_dim,
                                               input_index=len(op_schema.op._schema.returns),
                                               inplace_op=op_schema.op._schema.name.endswith("_"))

    def decorate(sharding_fn: Callable[..., Any]) -> Callable[..., Any]:
        for overload in op if isinstance(op, list) else [op]:
            DTensor._op_dispatcher.sharding_propagator.register_op_strategy(
                overload, functools.partial(strategy, sharding_fn))
        return sharding_fn

    return decorate


def _register_sharding() -> Callable[..., Any]:
    """torch's own ``register_sharding`` (2.5+), else this patch's."""
    import importlib

    try:
        experimental = importlib.import_module("torch.distributed.tensor.experimental")
    except ImportError:
        return register_sharding
    return vars(experimental).get("register_sharding", register_sharding)  # vars(): nothing served


def _fall_back(op: Any) -> bool:
    """Register the replicate-everything strategy for ``op``; False if it must not have one."""
    schema = op._schema
    if schema.is_mutable or not schema.returns:
        return False
    args = schema.arguments

    def replicate_all(*specs: Any, **kwspecs: Any) -> List[Tuple[List[Any], List[Any]]]:
        DTensorSpec, Replicate = placement_types()
        inputs = [Replicate() if isinstance(s, DTensorSpec) else None for s in (*specs, *kwspecs.values())]
        return [([Replicate()] * len(schema.returns), inputs)]

    _register_sharding()(op)(replicate_all)
    _fallen_back.add(op)
    ins = ", ".join("Shard(0)" if "Tensor" in str(a.type) else "None" for a in args)
    warnings.warn(_WARNING.format(
        op=op, qualname=f"{schema.name.replace('::', '.')}.{schema.overload_name or 'default'}",
        fn=schema.name.split("::")[-1], params=", ".join(a.name for a in args),
        outs="[" + ", ".join(["Shard(0)"] * len(schema.returns)) + "]", ins=f"[{ins}]",
    ), stacklevel=2)
    return True


def _reshard_like_inputs(outputs: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
    """Reshard replicated DTensor outputs like the first DTensor input of the same global shape."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    _, Replicate = placement_types()
    dtensor = dtensor_type()
    inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, dtensor)]

    def reshard(out: Any) -> Any:
        if not isinstance(out, dtensor):
            return out
        like = next((a for a in inputs if a.shape == out.shape), None)
        if like is None or all(isinstance(p, Replicate) for p in like.placements):
            return out
        assert all(isinstance(p, Replicate) for p in out.placements)
        return out.redistribute(like.device_mesh, like.placements)

    return tree_map(reshard, outputs) if not isinstance(outputs, torch.Tensor) else reshard(outputs)


# context_parallel's module on torch 2.13, 2.5-2.9 and 2.4.
_CONTEXT_PARALLEL = ("torch.distributed.tensor.experimental._context_parallel._attention",
                     "torch.distributed.tensor.experimental._attention",
                     "torch.distributed._tensor.experimental.attention")

_REORDERED = (
    "torchpatch (dtensor-op-fallback): {op} has no DTensor sharding strategy, and context_parallel is "
    "active with load balancing: its inputs are sharded along a reordered sequence, so running it on "
    "gathered inputs would compute over the reordered sequence (wrong for causal attention). "
    "context_parallel implements only the CUDA attention kernels (flash, efficient, cudnn). Set "
    "torch.distributed.tensor.experimental._attention._cp_options.enable_load_balance = False (the "
    "fallback is then exact) or register a sharding strategy for {op}."
)


def _refuse_under_load_balanced_context_parallel(dispatcher: Any, op: Any) -> None:
    """Raise if torch's context_parallel is active with load balancing (its sequence shards are
    reordered, which a gather-and-run fallback cannot know)."""
    handlers = getattr(dispatcher, "_custom_op_handlers", {})
    for name in _CONTEXT_PARALLEL:
        cp = sys.modules.get(name)
        options = getattr(cp, "_cp_options", None)
        ops = getattr(cp, "custom_ops", None) or getattr(cp, "customized_ops", None)
        if ops and getattr(options, "enable_load_balance", False) and all(o in handlers for o in ops):
            raise RuntimeError(_REORDERED.format(op=op))


def _falls_back(exc: BaseException, op: Any) -> bool:
    return _NO_STRATEGY in str(exc) and op not in _fallen_back and _fall_back(op)


# -- torch 2.4-2.9: OpDispatcher.dispatch in Python ------------------------------------------------

def _dispatch(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    op_call, op_args, op_kwargs = args[:3]
    if op_call not in _fallen_back:
        try:
            return wrapped(*args, **kwargs)
        except NotImplementedError as exc:
            if not _falls_back(exc, op_call):
                raise
    _refuse_under_load_balanced_context_parallel(instance, op_call)
    return _reshard_like_inputs(wrapped(*args, **kwargs), op_args, op_kwargs)


# -- torch 2.10+: dispatch in C++, calling back into Python for sharding propagation ---------------

def _propagate_slow_path(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                         kwargs: Dict[str, Any]) -> Any:
    try:
        return wrapped(*args, **kwargs)
    except NotImplementedError as exc:
        if not _falls_back(exc, args[0]):
            raise
    return wrapped(*args, **kwargs)


class _PendingSpec(threading.local):
    """The resharded local results of a fallen-back op and their spec, until C++ wraps them."""

    value: Optional[Tuple[Any, Any]] = None


_pending = _PendingSpec()


def _local_results_slow_path(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                             kwargs: Dict[str, Any]) -> Any:
    """For a fallen-back op, the replicated local results become the local shards of the input
    of the same shape; :func:`_wrap` hands C++ the spec that says so."""
    op_call, op_args, op_info = args[:3]
    if op_call not in _fallen_back:
        return wrapped(*args, **kwargs)
    _refuse_under_load_balanced_context_parallel(instance, op_call)
    results = wrapped(*args, **kwargs)
    if results is None:
        return results
    import torch
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    DTensorSpec, Replicate = placement_types()
    dtensor = dtensor_type()
    inputs = [a for a in op_args if isinstance(a, dtensor)]

    def reshard(local: Any, spec: Any) -> Tuple[Any, Any]:
        if not isinstance(local, torch.Tensor) or not isinstance(spec, DTensorSpec):
            return local, spec
        like = next((a for a in inputs if a.shape == local.shape), None)
        if like is None or all(isinstance(p, Replicate) for p in like.placements):
            return local, spec
        shape, offset = compute_local_shape_and_global_offset(local.shape, spec.mesh, like.placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        return local[index].contiguous(), DTensorSpec(spec.mesh, tuple(like.placements), tensor_meta=spec.tensor_meta)

    output_spec = op_info.output_sharding.output_spec
    if isinstance(results, torch.Tensor):
        results, spec = reshard(results, output_spec)
    else:
        pairs = [reshard(r, s) for r, s in zip(results, output_spec)]
        results = type(results)(r for r, _ in pairs)
        spec = tuple(s for _, s in pairs)
    _pending.value = (results, spec)
    return results


def _wrap(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``OpDispatcher.wrap(res, spec)``: the resharded spec for the results just made above."""
    pending, _pending.value = _pending.value, None
    if pending is not None and args and args[0] is pending[0]:
        return wrapped(args[0], pending[1])
    return wrapped(*args, **kwargs)


def _teach_op_dispatcher(patcher: Patcher, dispatch: ModuleType) -> Optional[bool]:
    cls = getattr(dispatch, "OpDispatcher", None)
    if cls is None or cls.__module__ != dispatch.__name__:  # absent, or re-exported from elsewhere
        return False
    if hasattr(cls, "dispatch"):
        patcher.wrap(cls, "dispatch", _dispatch)
        return True
    if not (hasattr(cls, "_propagate_op_sharding_dispatch_slow_path")
            and hasattr(cls, "_dispatch_get_local_results_slow_path") and hasattr(cls, "wrap")):
        import torch

        raise RuntimeError(f"torch {torch.__version__}'s C++ DTensor dispatch has no hook this patch knows")
    patcher.wrap(cls, "_propagate_op_sharding_dispatch_slow_path", _propagate_slow_path)
    patcher.wrap(cls, "_dispatch_get_local_results_slow_path", _local_results_slow_path)
    patcher.wrap(cls, "wrap", _wrap)
    return True


for _module in DISPATCH_MODULES:
    PATCH.on_import(_module)(_teach_op_dispatcher)


@PATCH.symbol("torch.distributed._tensor.experimental", "register_sharding")
def serve_register_sharding() -> Callable[..., Any]:
    return _register_sharding()

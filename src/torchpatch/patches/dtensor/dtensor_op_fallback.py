"""dtensor-op-fallback: an op with no DTensor sharding strategy runs on replicated inputs instead
of failing; ``register_sharding`` where torch lacks it, torch 2.4 and later.

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
               Ops that have a strategy pay nothing: the patch sits in sharding propagation's
               cache miss (``ShardingPropagator.propagate_op_sharding_non_cached``), and an op
               that torch decomposes (CompositeImplicitAutograd) is left to torch. Results are
               resharded in ``OpDispatcher.wrap`` (torch 2.4-2.9; wrapped only once an op fell
               back) or, where C++ dispatches (2.10+), in its local-results slow path.
Pitfalls:      the fallback is correct but not fast: every sharded input is gathered on every
               call. The warning is the reminder to register a strategy. On torch 2.4-2.9, once
               an op fell back, every DTensor op of the process makes one Python call more.
Upstream:      https://github.com/pytorch/pytorch/pull/131108 (register_sharding, torch 2.5)
"""

import functools
import sys
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torchpatch import Error, Patch, Patcher
from torchpatch.patches.dtensor._internals import DISPATCH_MODULES, dtensor_type, placement_types
from torchpatch.patches.dtensor._internals import route_sharding_cache as _route_cache

PATCH = Patch(
    id="dtensor-op-fallback",
    summary="ops without a DTensor sharding strategy run on replicated inputs (one warning per op); "
    "register_sharding where torch lacks it (2.4)",
    torch=">=2.4",
    upstream="https://github.com/pytorch/pytorch/pull/131108",
    behaviour="DTensor ops without a sharding strategy gather their inputs and run",
    errors=(
        Error(r'Operator (?!aten\.(?:linspace|logspace)\.)[\w.]+ does not have a sharding strategy registered',
              "NotImplementedError: Operator tpmix.fused_attn.default does not have a sharding strategy registered."),
    ),
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
    import torch

    if _NO_STRATEGY not in str(exc) or op in _fallen_back:
        return False
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), torch._C.DispatchKey.CompositeImplicitAutograd):
        return False  # torch decomposes it when propagation fails (2.9+); its parts fall back if need be
    return _fall_back(op)


# -- where it hooks: sharding propagation on a cache miss, then OpDispatcher.wrap once an op fell back

# id(output spec) -> (that spec, the op, placements of the input it is resharded like, or None).
_resharded: Dict[int, Tuple[Any, Any, Optional[Tuple[Any, ...]]]] = {}
_wrap_lock = threading.Lock()


def _reshard_like(spec: Any, op_schema: Any) -> Optional[Tuple[Any, ...]]:
    """The placements of the first DTensor input of ``spec``'s global shape that is sharded (its
    Partials kept replicated: a full value cannot be claimed as a share), or None."""
    from torch.utils._pytree import tree_flatten

    DTensorSpec, Replicate = placement_types()
    if not isinstance(spec, DTensorSpec) or spec.tensor_meta is None:
        return None
    inputs = [a for a in tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))[0]
              if isinstance(a, DTensorSpec) and a.tensor_meta is not None]
    like = next((a for a in inputs if a.tensor_meta.shape == spec.tensor_meta.shape), None)
    if like is None or not any(p.is_shard() for p in like.placements):
        return None
    return tuple(p if p.is_shard() else Replicate() for p in like.placements)


def _propagate(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``ShardingPropagator.propagate_op_sharding_non_cached`` (only on a sharding-cache miss): an op
    with no strategy gets the replicate-everything one, and its output specs are noted for
    :func:`_wrap`, which reshards results like their input."""
    op_schema = args[0] if args else kwargs["op_schema"]
    op = op_schema.op
    if op not in _fallen_back:
        try:
            return wrapped(*args, **kwargs)
        except NotImplementedError as exc:
            if not _falls_back(exc, op):
                raise
        _hook_wrap()
    sharding = wrapped(*args, **kwargs)
    outputs = sharding.output_spec
    _resharded[id(outputs)] = (outputs, op, _reshard_like(outputs, op_schema))
    for spec in outputs if isinstance(outputs, (list, tuple)) else ():
        _resharded[id(spec)] = (spec, op, _reshard_like(spec, op_schema))
    return sharding


def _resharded_result(result: Any, spec: Any) -> Optional[Tuple[Any, Any]]:
    """(local shard, its spec) for a replicated result of an op that fell back, where it is to be
    resharded like an input; None where it stays as it is. Refused under load-balanced context
    parallel."""
    entry = _resharded.get(id(spec))
    if entry is None or entry[0] is not spec:
        return None
    _, op, placements = entry
    _refuse_under_load_balanced_context_parallel(dtensor_type()._op_dispatcher, op)
    import torch

    if placements is None or not isinstance(result, torch.Tensor):
        return None
    DTensorSpec, _ = placement_types()
    shape, offset = _local_shape_and_offset()(spec.tensor_meta.shape, spec.mesh, placements)
    local = result[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()
    return local, DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _wrap(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``OpDispatcher.wrap(result, spec)`` (torch 2.4-2.9) once an op fell back: its results
    resharded like their input."""
    resharded = _resharded_result(*args[:2]) if len(args) >= 2 else None
    return wrapped(*args, **kwargs) if resharded is None else wrapped(*resharded)


def _local_results(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Any:
    """``OpDispatcher._dispatch_get_local_results_slow_path`` (torch 2.10+, whose C++ dispatch
    wraps the results itself, with the output spec of the sharding it cached): for an op that fell
    back, the results resharded, and that sharding's output spec made the resharded one the first
    time (noted, so that later calls reshard their replicated results the same way)."""
    op_call, _, op_info = args[:3]
    results = wrapped(*args, **kwargs)
    if op_call not in _fallen_back or results is None:
        return results
    sharding = op_info.output_sharding
    specs = sharding.output_spec
    if isinstance(results, (list, tuple)):
        _resharded_result(results, specs)  # the refusal, for the tuple as a whole
        pairs = [_resharded_result(r, s) or (r, s) for r, s in zip(results, specs)]
        results, new = type(results)(r for r, _ in pairs), tuple(s for _, s in pairs)
    else:
        results, new = _resharded_result(results, specs) or (results, specs)
    if new != specs:
        op = _resharded[id(specs)][1]
        for spec in ((new, *new) if isinstance(new, tuple) else (new,)):  # a tuple: for the refusal
            _resharded[id(spec)] = (spec, op, getattr(spec, "placements", None))
        sharding.output_spec = new
    return results


def _local_shape_and_offset() -> Callable[..., Any]:
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    return compute_local_shape_and_global_offset


_installed: Dict[str, Any] = {}  # "patcher" and "dispatcher": what _hook_wrap installs with


def _hook_wrap() -> None:
    """Wrap ``OpDispatcher.wrap`` (called on every op, torch 2.4-2.9) the first time an op falls
    back: until then no op pays for it."""
    with _wrap_lock:
        if "wrapped" not in _installed and hasattr(_installed["dispatcher"], "dispatch"):
            _installed["wrapped"] = _installed["patcher"].wrap(_installed["dispatcher"], "wrap", _wrap)


def _teach_op_dispatcher(patcher: Patcher, dispatch: ModuleType) -> Optional[bool]:
    cls = getattr(dispatch, "OpDispatcher", None)
    if cls is None or cls.__module__ != dispatch.__name__:  # absent, or re-exported from elsewhere
        return False
    propagator = getattr(dispatch, "ShardingPropagator", None)
    if propagator is None or not hasattr(propagator, "propagate_op_sharding_non_cached") or not hasattr(cls, "wrap"):
        import torch

        raise RuntimeError(f"torch {torch.__version__}'s DTensor dispatch has no hook this patch knows")
    patcher.wrap(propagator, "propagate_op_sharding_non_cached", _propagate)
    api = sys.modules.get("torch.distributed.tensor._api") or sys.modules.get("torch.distributed._tensor.api")
    existing = getattr(getattr(api, "DTensor", None), "_op_dispatcher", None)
    if existing is not None:  # DTensor imported before torchpatch was installed
        _route_cache(patcher, existing.sharding_propagator)
    if not hasattr(cls, "dispatch"):  # torch 2.10+: dispatch in C++, which wraps results itself
        patcher.wrap(cls, "_dispatch_get_local_results_slow_path", _local_results)
    _installed.update(patcher=patcher, dispatcher=cls)
    patcher.on_undo(lambda: (_installed.clear(), _resharded.clear()))
    return True


for _module in DISPATCH_MODULES:
    PATCH.on_import(_module)(_teach_op_dispatcher)


@PATCH.symbol("torch.distributed._tensor.experimental", "register_sharding")
def serve_register_sharding() -> Callable[..., Any]:
    return _register_sharding()

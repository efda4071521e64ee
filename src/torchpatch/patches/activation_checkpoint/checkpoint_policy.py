"""checkpoint-policy: selective activation checkpointing's public names of torch 2.5
(``CheckpointPolicy``, ``SelectiveCheckpointContext``, ``create_selective_checkpoint_contexts``) where
torch lacks them, and the private name torchtitan used before them where torch lacks that, torch 2.1
and later.

What breaks:   torchtitan's selective op checkpointing (its Llama 3 8B config uses it) and code
               written for torch 2.5's public API die on torch 2.1-2.4 with
               ``ImportError: cannot import name 'CheckpointPolicy' from 'torch.utils.checkpoint'``.
               torchtitan before its PR #397 imported ``from torch.utils.checkpoint import
               _pt2_selective_checkpoint_context_fn_gen``, which only torch 2.4 has: ``ImportError:
               cannot import name '_pt2_selective_checkpoint_context_fn_gen'`` everywhere else.
               On torch 2.1 torchtitan's ``checkpoint_wrapper(block, context_fn=...)`` then fails
               with ``ValueError: Passing `context_fn` or `debug` is only supported when
               use_reentrant=False``: 2.1's wrapper still defaulted to REENTRANT.
Torch:         public names: 2.1 (the first ``checkpoint`` with ``context_fn``, pytorch#96783) to
               2.4; private name: 2.1-2.3 and 2.5+; the wrapper default: 2.1.
Fix:           - The public names, served where missing, work as torch 2.13's (the reference):
                 ``create_selective_checkpoint_contexts(policy_fn or list of OpOverloads,
                 allow_cache_entry_mutation=False)`` returns two TorchDispatchModes for
                 ``checkpoint(fn, ..., use_reentrant=False, context_fn=...)``. In the forward pass
                 the first runs each op, then asks the policy (ctx.is_recompute False,
                 ctx.op_output set) and caches the outputs of ops to save as detached aliases that
                 share the output's version counter. During the backward recomputation the second
                 hands back the n-th cached output of an op instead of running it and runs the rest;
                 a mutated cached tensor or a second backward raise as in torch. ``*_SAVE`` save,
                 ``*_RECOMPUTE`` recompute (MUST vs PREFER matters only to torch.compile), a bool
                 policy means MUST_SAVE/PREFER_RECOMPUTE. The enum has 2.5's four members (2.13's
                 ``*_CPU_OFFLOAD`` act only in the compile partitioner).
               - Eager only: under torch.compile (2.4 with its experimental context_fn flag; 2.1-2.3
                 refuse context_fn themselves) the served modes raise ``NotImplementedError``, as
                 the policy would have to reach a partitioner that understands it (2.5+).
               - ``_pt2_selective_checkpoint_context_fn_gen(policy_fn)``, served where missing, is
                 built on the public function (torch's own on 2.5+): ``policy_fn(mode, func, ...)``
                 gets "forward" or "recompute" from ctx.is_recompute, True maps to MUST_SAVE and
                 False to PREFER_RECOMPUTE, as torch 2.5 maps bool policies. Where torch asks the
                 policy in the forward pass only (2.13) mode is always "forward" and decisions
                 replay by position; torchtitan's counting policy gives the same result.
               - torch 2.1: ``checkpoint_wrapper`` called with ``context_fn`` and no
                 ``checkpoint_impl`` gets NO_REENTRANT, 2.2's default (pytorch#108435); reentrant
                 refuses ``context_fn``, so no working call changes.
Upstream:      https://github.com/pytorch/pytorch/pull/125795 (made public and renamed in 2.5);
               torchtitan's switch: https://github.com/pytorch/torchtitan/pull/397
"""

import enum
import functools
import inspect
from collections import defaultdict
from types import ModuleType
from typing import Any, Callable, Dict, List, Set, Tuple, Union

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="checkpoint-policy",
    summary="selective activation checkpointing (CheckpointPolicy, create_selective_checkpoint_contexts) "
            "before torch 2.5; torchtitan's private _pt2_selective_checkpoint_context_fn_gen after",
    torch=">=2.1",
    upstream="https://github.com/pytorch/pytorch/pull/125795",
    behaviour="torch 2.1: checkpoint_wrapper(..., context_fn=...) defaults to NO_REENTRANT",
)

_MODULE = "torch.utils.checkpoint"


class CheckpointPolicy(enum.Enum):
    """What selective activation checkpointing does with an op's output: ``*_SAVE`` caches it in
    the forward pass, ``*_RECOMPUTE`` runs the op again in backward. ``MUST_*`` over ``PREFER_*``
    says other subsystems (torch.compile) must not override the choice."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3


class SelectiveCheckpointContext:
    """Passed to the policy function: ``is_recompute`` (always False, the policy is asked in the
    forward pass only) and ``op_output``, the op's output."""

    def __init__(self, *, is_recompute: bool, op_output: Any = None) -> None:
        self.is_recompute = is_recompute
        self.op_output = op_output


_SAVE = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
_RECOMPUTE = object()  # storage entry: this op's n-th call is recomputed
_CONSUMED = object()  # storage entry: handed back once already
_MISMATCH = ("This can happen if the operations in the checkpointed region are nondeterministic "
             "or depend on global state that changed between forward and backward.")

PolicyFn = Callable[..., Union[CheckpointPolicy, bool]]


def _policy_from_bool(save: bool) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _ignored_ops() -> Set[Any]:
    """Ops checkpointing itself runs a different number of times in forward and recompute (detach in
    the saved-tensor hooks, metadata queries of the determinism check): never cached. On torch 2.4
    the very set torch's own SAC consults (``SAC_IGNORED_OPS``), so what code adds to it counts."""
    import torch
    import torch.utils.checkpoint as checkpoint

    if isinstance(getattr(checkpoint, "_ignored_ops", None), set):
        return checkpoint._ignored_ops
    aten = torch.ops.aten
    ignored = {aten.detach.default, torch.ops.prim.device.default}
    for name, overload in [("is_contiguous", "default"), ("is_contiguous", "memory_format"),
                           ("is_strides_like_format", "default"),
                           ("is_non_overlapping_and_dense", "default"), ("size", "default"),
                           ("sym_size", "default"), ("stride", "default"), ("sym_stride", "default"),
                           ("storage_offset", "default"), ("sym_storage_offset", "default"),
                           ("numel", "default"), ("sym_numel", "default"), ("dim", "default")]:
        op = getattr(getattr(aten, name, None), overload, None)
        if op is not None:
            ignored.add(op)
    return ignored


@functools.lru_cache(maxsize=None)
def _modes() -> Tuple[type, type]:
    """The two TorchDispatchMode classes, made on first use (torch is not imported at start-up)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    ignored = _ignored_ops()
    mode_keys = getattr(torch._C, "_TorchDispatchModeKey", None)  # absent on 2.1
    views = torch._C.DispatchKey.ADInplaceOrView

    def detach(x: Any) -> Any:
        """Detach with the ADInplaceOrView key re-enabled (a dispatch mode runs below it, where
        detach makes an alias with a fresh version counter): the cached alias shares the output's
        version counter, so in-place changes to it are seen, and has no autograd metadata. The
        guard torch 2.4+ has for this (_SetExcludeDispatchKeyGuard) is missing on 2.1."""
        if not isinstance(x, torch.Tensor):
            return x
        excluded = torch._C._dispatch_tls_is_dispatch_key_excluded(views)
        torch._C._dispatch_tls_set_dispatch_key_excluded(views, False)
        try:
            return x.detach()
        finally:
            torch._C._dispatch_tls_set_dispatch_key_excluded(views, excluded)

    def refuse_compile(args: Tuple[Any, ...]) -> None:
        """AOTAutograd traces through functionalization: a FunctionalTensorMode (2.4) or C++
        functional tensors (earlier) mean the region is being compiled."""
        if (mode_keys is not None and torch._C._get_dispatch_mode(mode_keys.FUNCTIONAL) is not None) \
                or any(isinstance(a, torch.Tensor) and torch._is_functional_tensor(a) for a in args):
            raise NotImplementedError(
                "torchpatch serves selective activation checkpointing (create_selective_checkpoint_"
                f"contexts) on torch {torch.__version__} for eager mode only: under torch.compile "
                "the policy has to reach the partitioner, which needs torch >= 2.5. Checkpoint this "
                "region outside torch.compile, or use torch 2.4's own "
                "_pt2_selective_checkpoint_context_fn_gen there.")

    class Version:
        """A cached value and the version its tensor had when cached."""

        def __init__(self, value: Any) -> None:
            self.value = value
            self.version = value._version if isinstance(value, torch.Tensor) else None

        def get(self, allow_mutation: bool) -> Any:
            if self.version is not None and not allow_mutation and self.value._version != self.version:
                raise RuntimeError("Tensor cached during selective activation checkpoint has been mutated")
            return self.value

    class Caching(TorchDispatchMode):
        """Forward pass: runs each op, asks the policy, caches the outputs of ops to save."""

        def __init__(self, policy_fn: PolicyFn, storage: Dict[Any, Dict[int, Any]]) -> None:
            super().__init__()
            self.policy_fn = policy_fn
            self.storage = storage
            self.calls: Dict[Any, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = {} if kwargs is None else kwargs
            if func in ignored:
                return func(*args, **kwargs)
            refuse_compile(args)
            out = func(*args, **kwargs)
            index = self.calls[func]
            self.calls[func] += 1
            policy = self.policy_fn(SelectiveCheckpointContext(is_recompute=False, op_output=out),
                                    func, *args, **kwargs)
            if isinstance(policy, bool):
                policy = _policy_from_bool(policy)
            if not isinstance(policy, CheckpointPolicy):
                raise TypeError(f"selective checkpoint policy returned {policy!r} for {func}; "
                                "expected a CheckpointPolicy or a bool")
            if policy in _SAVE:
                self.storage[func][index] = tree_map(lambda x: Version(detach(x)), out)
            else:
                self.storage[func][index] = _RECOMPUTE
            return out

    class Cached(TorchDispatchMode):
        """Recomputation: hands back the n-th cached output of an op, or runs it again."""

        def __init__(self, storage: Dict[Any, Dict[int, Any]], allow_cache_entry_mutation: bool) -> None:
            super().__init__()
            self.storage = storage
            self.allow_cache_entry_mutation = allow_cache_entry_mutation
            self.calls: Dict[Any, int] = defaultdict(int)

        def __enter__(self):
            self.calls.clear()  # each recomputation replays from the first call of every op
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = {} if kwargs is None else kwargs
            if func in ignored:
                return func(*args, **kwargs)
            index = self.calls[func]
            self.calls[func] += 1
            entry = self.storage.get(func, {}).get(index)
            if entry is None:
                raise RuntimeError(f"{func} call {index} encountered during backward but not found "
                                   f"in the selective checkpoint storage. {_MISMATCH}")
            if entry is _CONSUMED:
                raise RuntimeError("Trying to backward an extra time. You are only allowed to backward "
                                   "once on any region computed under selective activation checkpoint.")
            if entry is _RECOMPUTE:
                return func(*args, **kwargs)
            self.storage[func][index] = _CONSUMED
            return tree_map(lambda v: v.get(self.allow_cache_entry_mutation), entry)

    return Caching, Cached


def create_selective_checkpoint_contexts(policy_fn_or_list: Union[PolicyFn, List[Any]],
                                         allow_cache_entry_mutation: bool = False) -> Tuple[Any, Any]:
    """The ``(forward, recompute)`` contexts for ``checkpoint(..., use_reentrant=False,
    context_fn=...)``: ``policy_fn(ctx, func, *args, **kwargs)`` returns a
    :class:`CheckpointPolicy` (or a bool, True saves); a list of OpOverloads saves those ops and
    recomputes the rest. A cached tensor mutated before backward raises unless
    ``allow_cache_entry_mutation``."""
    import torch

    if isinstance(policy_fn_or_list, list):
        for op in policy_fn_or_list:
            if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
                hint = (" Please update the OpOverloadPacket to a specific OpOverload, e.g. "
                        "torch.ops.aten.mm -> torch.ops.aten.mm.default."
                        if isinstance(op, torch._ops.OpOverloadPacket) else "")
                raise ValueError(f"Expected op in `op_list` to be an OpOverload but got: {op} "
                                 f"of type {type(op)}.{hint}")
        ops = list(policy_fn_or_list)

        def policy_fn(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE
    elif callable(policy_fn_or_list):
        policy_fn = policy_fn_or_list
    else:
        raise TypeError("policy_fn_or_list must be either a function or a list of ops.")
    caching, cached = _modes()
    storage: Dict[Any, Dict[int, Any]] = defaultdict(dict)
    return caching(policy_fn, storage), cached(storage, allow_cache_entry_mutation)


@PATCH.symbol(_MODULE, "CheckpointPolicy")
def _checkpoint_policy() -> type:
    return CheckpointPolicy


@PATCH.symbol(_MODULE, "SelectiveCheckpointContext")
def _selective_checkpoint_context() -> type:
    return SelectiveCheckpointContext


@PATCH.symbol(_MODULE, "create_selective_checkpoint_contexts")
def _create_selective_checkpoint_contexts() -> Callable[..., Tuple[Any, Any]]:
    return create_selective_checkpoint_contexts


@PATCH.symbol(_MODULE, "_pt2_selective_checkpoint_context_fn_gen")
def _pt2_gen() -> Callable[[Callable[..., bool]], Tuple[Any, Any]]:
    import torch.utils.checkpoint as cp

    # torch's own public API where it has one (2.5+), the one served above on 2.1-2.3
    create, policy_enum = cp.create_selective_checkpoint_contexts, cp.CheckpointPolicy

    def _pt2_selective_checkpoint_context_fn_gen(policy_fn: Callable[..., bool]) -> Tuple[Any, Any]:
        """torch 2.4's private form: ``policy_fn(mode, func, *args, **kwargs) -> bool`` with mode
        "forward" or "recompute"; True means the op's output is saved, not recomputed."""

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            mode = "recompute" if ctx.is_recompute else "forward"
            save = bool(policy_fn(mode, func, *args, **kwargs))
            return policy_enum.MUST_SAVE if save else policy_enum.PREFER_RECOMPUTE

        return create(policy)

    return _pt2_selective_checkpoint_context_fn_gen


@PATCH.on_import("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
def _non_reentrant_for_context_fn(patcher: Patcher, module: ModuleType) -> bool:
    impl = module.CheckpointImpl
    param = inspect.signature(module.checkpoint_wrapper).parameters.get("checkpoint_impl")
    if param is None or param.default is not impl.REENTRANT:
        return False  # torch >= 2.2 defaults to NO_REENTRANT

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if "context_fn" in kwargs and "checkpoint_impl" not in kwargs and len(args) < 2:
            kwargs = dict(kwargs, checkpoint_impl=impl.NO_REENTRANT)  # reentrant refuses context_fn
        return wrapped(*args, **kwargs)

    patcher.wrap(module, "checkpoint_wrapper", wrapper)
    return True

"""dtensor-implicit-replication: a plain ``torch.Tensor`` mixed with DTensors is treated as
replicated, with a check that it is not a local shard passed by mistake, torch 2.1 and later.

What breaks:   any op that receives a DTensor and a plain tensor (``dtensor + bias``, a vendor
               attention kernel called with DTensor q/k/v and a plain mask) fails with
               ``RuntimeError: aten.add.Tensor: got mixed torch.Tensor and DTensor, need to
               convert all torch.Tensor to DTensor before calling distributed operators!``
               (torchtitan's context parallel on Ascend NPUs hit it in ``npu_fusion_attention``).
Torch:         every torch with DTensor (2.1-2.13). Torch >= 2.2 replicates plain tensors only
               inside ``torch.distributed.tensor.experimental.implicit_replication()`` (2.4+ also
               one-element tensors); torch 2.1 has no such mechanism at all.
Fix:           outside an explicit ``implicit_replication()`` block, a plain tensor argument of a
               DTensor op goes in as a DTensor replicated on the mesh of the op's DTensors (the
               plain tensor is the local tensor on every rank, as torch's own context does).
               Safety first: a plain tensor whose shape equals a DTensor argument's *local shard*
               shape but not its global shape is almost certainly a shard passed by mistake: that
               raises a ``RuntimeError`` naming the op, both shapes and the fixes, instead of
               computing garbage. Inside an explicit ``implicit_replication()`` torch's semantics
               stand, unchecked. Where the hook sits:
               - torch 2.1: around ``dispatch._operator_dispatch``, on top of the replication that
                 ``dtensor-experimental`` teaches it (which this patch requires there);
               - torch 2.2-2.9 (dispatch in Python): torch's switch is on for good (a property of
                 ``OpDispatcher`` that keeps the explicit state apart); torch reads it only when a
                 plain tensor of more than one element meets DTensors, and the check runs in that
                 read, on the arguments of the op being unwrapped: nothing on any other op;
               - torch 2.10+ (dispatch in C++, switch thread-local in C++): torch's switch is on in
                 the thread that imports DTensor, ``OpDispatcher._allow_implicit_replication``
                 keeps the explicit state apart, and the check runs where C++ calls back into
                 Python for sharding propagation (on each sharding-cache miss).
Pitfalls:      on torch 2.10+ a Python thread started by the user has torch's switch off (it is
               thread-local in C++): plain tensors there raise the native error. The check there
               runs once per distinct (op, shapes, placements): a mistaken shard that torch's own
               ``implicit_replication()`` already let through with the same shapes is not caught.
Upstream:      https://github.com/pytorch/pytorch/pull/115297 (implicit_replication, torch 2.2);
               https://github.com/pytorch/pytorch/issues/124826 (mixed tensors, the request)
"""

import sys
import threading
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple

from torchpatch import Error, Patch, Patcher
from torchpatch.patches.dtensor._internals import DISPATCH_MODULES, dtensor_type

PATCH = Patch(
    id="dtensor-implicit-replication",
    summary="plain tensors mixed with DTensors are replicated, a local shard passed by mistake raises",
    torch=">=2.1",
    upstream="https://github.com/pytorch/pytorch/pull/115297",
    requires=("dtensor-experimental",),  # torch 2.1 only: the dispatch change it builds on
    behaviour="DTensor ops replicate plain torch.Tensor arguments (checked against local shards)",
    errors=(
        Error(r'got mixed torch\.Tensor and DTensor, need to convert all torch\.Tensor to DTensor',
              "RuntimeError: aten.add.Tensor: got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling distributed operators!"),
    ),
)

_SHARD_MISTAKE = (
    "torchpatch (dtensor-implicit-replication): {op} got a plain torch.Tensor of shape {plain} mixed "
    "with a DTensor of global shape {glob} and placements {placements}, whose local shard on this rank "
    "has exactly that shape: this looks like a local shard passed where the whole tensor is meant. "
    "If it is a shard, wrap it: DTensor.from_local(t, mesh, {placements}); if it is the same tensor "
    "on every rank with that shape, replicate it explicitly (distribute_tensor(t, mesh, [Replicate()]) "
    "or torch.distributed.tensor.experimental.implicit_replication()). "
    "TORCHPATCH_DISABLE=dtensor-implicit-replication turns automatic replication off."
)


def _tensors(args: Any, kwargs: Dict[str, Any]) -> Iterator[Any]:
    """The op's arguments, one level into lists and tuples (where tensors of ops sit)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def check_plain_tensors(op: Any, args: Any, kwargs: Dict[str, Any], dtensor_cls: type) -> None:
    """Raise if a plain tensor among the op's arguments has the local-shard shape (but not the
    global shape) of one of its DTensors, in a dimension where that shard has more than one
    element (a size-1 dimension is broadcasting, not a mistake)."""
    import torch

    plain, dtensors = [], []
    for value in _tensors(args, kwargs):
        if isinstance(value, dtensor_cls):
            dtensors.append(value)
        elif isinstance(value, torch.Tensor) and value.numel() > 1:
            plain.append(value)
    for tensor in plain:
        for dt in dtensors:
            local, glob = tuple(dt._local_tensor.shape), tuple(dt.shape)
            if tuple(tensor.shape) == local != glob and any(l != g and l > 1 for l, g in zip(local, glob)):
                raise RuntimeError(_SHARD_MISTAKE.format(op=op, plain=tuple(tensor.shape), glob=glob,
                                                         placements=list(dt.placements)))


# -- torch 2.1: on top of dtensor-experimental's replicating _operator_dispatch ------------------

def _operator_dispatch_21(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> Any:
    from torch.distributed._tensor.api import DTensor

    from torchpatch.patches.dtensor import dtensor_experimental as experimental

    if experimental._replicate:  # inside an explicit implicit_replication(): torch's semantics
        return wrapped(*args, **kwargs)
    op_call, op_args, op_kwargs = args[:3]
    check_plain_tensors(op_call, op_args, op_kwargs, DTensor)
    previous = experimental.replicate_plain_tensors(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        experimental.replicate_plain_tensors(previous)


@PATCH.on_import("torch.distributed._tensor.dispatch")
def replicate_in_dispatch_21(patcher: Patcher, dispatch: ModuleType) -> bool:
    if not hasattr(dispatch, "_operator_dispatch") or hasattr(dispatch, "OpDispatcher"):
        return False
    from torchpatch.patches.dtensor import dtensor_experimental as experimental

    if not experimental._dispatch_taught():
        raise RuntimeError("torch 2.1's DTensor dispatch lacks dtensor-experimental's replication, "
                           "which this patch builds on")
    patcher.wrap(dispatch, "_operator_dispatch", _operator_dispatch_21)
    return True


# -- torch 2.2-2.9: OpDispatcher in Python, torch's switch read only for plain tensors ------------

def _replicating(self: Any) -> bool:
    """Torch's switch as its dispatch reads it: always on. Torch reads it only when a plain tensor
    with more than one element meets DTensors (in ``unwrap_to_op_info``), so the check runs there,
    on the arguments of the op being unwrapped, and nowhere else; not inside torch's own
    ``implicit_replication()`` (the value it set is kept where torch kept it, on the instance)."""
    if not vars(self).get("_allow_implicit_replication", False):
        frame = sys._getframe(1)
        for _ in range(3):  # unwrap_to_op_info, or its helper one frame below (torch 2.2-2.4)
            if frame is None:
                break
            if frame.f_code in _UNWRAP_CODES:
                local = frame.f_locals
                check_plain_tensors(local["op_call"], local["args"], local["kwargs"], dtensor_type())
                break
            frame = frame.f_back
    return True


def _set_explicit(self: Any, value: bool) -> None:
    vars(self)["_allow_implicit_replication"] = bool(value)


_UNWRAP_CODES: Set[Any] = set()  # the code of OpDispatcher.unwrap_to_op_info (one per torch loaded)


# -- torch 2.10+: dispatch in C++, the switch thread-local in C++ ----------------------------------

class _ExplicitState(threading.local):
    """Whether torch's own ``implicit_replication()`` (or code setting the switch) is active in
    this thread, apart from the replication torchpatch keeps on."""

    active = False


_explicit = _ExplicitState()


def _set_switch(self: Any, value: bool) -> None:
    import torch

    _explicit.active = bool(value)
    torch._C._set_dtensor_allow_implicit_replication(True)  # torchpatch's replication stays on


def _propagate_slow_path(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                         kwargs: Dict[str, Any]) -> Any:
    if not _explicit.active:
        op_call, op_args, op_kwargs = args[:3]
        check_plain_tensors(op_call, op_args, op_kwargs, dtensor_type())
    return wrapped(*args, **kwargs)


def _teach_op_dispatcher(patcher: Patcher, dispatch: ModuleType) -> Optional[bool]:
    cls = getattr(dispatch, "OpDispatcher", None)
    if cls is None or cls.__module__ != dispatch.__name__:  # absent, or re-exported from elsewhere
        return False
    if hasattr(cls, "dispatch"):  # Python dispatch: torch's switch, on for good, checked where read
        code = cls.unwrap_to_op_info.__code__
        if code.co_varnames[:4] != ("self", "op_call", "args", "kwargs"):
            raise RuntimeError("OpDispatcher.unwrap_to_op_info takes arguments this patch does not know")
        _UNWRAP_CODES.add(code)
        patcher.on_undo(lambda: _UNWRAP_CODES.discard(code))
        patcher.setattr(cls, "_allow_implicit_replication", property(_replicating, _set_explicit))
        return True
    import torch

    switch = vars(cls).get("_allow_implicit_replication")
    if not (isinstance(switch, property)
            and hasattr(cls, "_propagate_op_sharding_dispatch_slow_path")
            and hasattr(torch._C, "_set_dtensor_allow_implicit_replication")):
        raise RuntimeError(f"torch {torch.__version__}'s C++ DTensor dispatch has no hook this patch knows")
    # Reading gives torch's switch (on); setting records the explicit state and keeps it on.
    patcher.setattr(cls, "_allow_implicit_replication", property(switch.fget, _set_switch))
    patcher.wrap(cls, "_propagate_op_sharding_dispatch_slow_path", _propagate_slow_path)
    torch._C._set_dtensor_allow_implicit_replication(True)
    patcher.on_undo(lambda: torch._C._set_dtensor_allow_implicit_replication(False))
    return True


for _module in DISPATCH_MODULES:
    PATCH.on_import(_module)(_teach_op_dispatcher)

"""dtensor-experimental: ``torch.distributed.tensor.experimental`` (``implicit_replication``,
``local_map``), and implicit replication taught to torch 2.1's DTensor dispatch, torch 2.1-2.4.

What breaks:   code written for torch >= 2.5 (torchtitan, transformers' tensor parallel, accelerate)
               does ``from torch.distributed.tensor.experimental import implicit_replication`` (or
               ``local_map``) and dies with ``ModuleNotFoundError: No module named
               'torch.distributed.tensor.experimental'``. On torch 2.1 there is no implicit
               replication at all: a DTensor op with a plain ``torch.Tensor`` argument
               (``dtensor + bias``) always raises ``RuntimeError: aten.add.Tensor: got mixed
               torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before
               calling distributed operators!``.
Torch:         2.2–2.4 keep both in the private ``torch.distributed._tensor.experimental``
               (``local_map`` from 2.4); 2.1 has neither the package nor the mechanism, its
               mixed-tensor check is hard-coded in ``torch.distributed._tensor.dispatch``.
               1.13 has no DTensor: nothing is served there. 2.5 and later have it all natively.
Fix:           serve ``torch.distributed.tensor.experimental`` as the very module
               ``torch.distributed._tensor.experimental`` (2.2–2.4: torch's own; submodules such as
               ``...experimental.local_map`` are torch's own too). On 2.1 that module is served
               with two functions:
               - ``implicit_replication()``, a context manager under which a DTensor op treats its
                 plain ``torch.Tensor`` arguments as replicated on the mesh of its first DTensor
                 argument, as torch >= 2.2 does: 2.1's ``dispatch._operator_dispatch`` is wrapped to
                 hand each plain tensor in as a DTensor whose local tensor is that very tensor, with
                 ``Replicate()`` on every mesh dimension, before sharding propagation. Outside the
                 context the native error stays, also for one-element tensors (which 2.4 always
                 replicates). Leaving the context restores the state it found (torch >= 2.2 turns
                 it off, even from a nested context). :func:`replicate_plain_tensors` is the same
                 switch for other patches, which may keep it on.
               - ``local_map(func, out_placements, in_placements=None, device_mesh=None, *,
                 redistribute_inputs=False)`` with torch 2.4's semantics; also served on 2.2–2.3,
                 whose package lacks it. The ``in_grad_placements`` of later torch is not served,
                 nor are their other experimental names (``context_parallel``,
                 ``register_sharding``).
Upstream:      https://github.com/pytorch/pytorch/pull/115297 (implicit replication, torch 2.2);
               https://github.com/pytorch/pytorch/pull/126924 (``local_map`` as in torch 2.4);
               https://github.com/pytorch/pytorch/pull/133881 (``torch.distributed.tensor`` public, 2.5)
"""

import contextlib
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

from torchpatch import Error, Patch, Patcher

PATCH = Patch(
    id="dtensor-experimental",
    summary="torch.distributed.tensor.experimental (implicit_replication, local_map) on torch 2.1-2.4; "
    "implicit replication in torch 2.1's DTensor dispatch",
    torch=">=2.1,<2.5",
    upstream="https://github.com/pytorch/pytorch/pull/115297",
    behaviour="DTensor ops replicate plain tensors under implicit_replication() on torch 2.1",
    errors=(
        Error(r'got mixed torch\.Tensor and DTensor, need to convert all torch\.Tensor to DTensor',
              "RuntimeError: aten.add.Tensor: got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor before calling distributed operators!"),
    ),
)

PATCH.alias("torch.distributed.tensor.experimental", "torch.distributed._tensor.experimental")

PlacementType = Optional[Sequence[Any]]
InputPlacements = Optional[Tuple[PlacementType, ...]]
OutputPlacements = Union[PlacementType, Tuple[PlacementType, ...]]

# The one switch torch 2.1's patched dispatch reads (torch >= 2.2's
# ``DTensor._op_dispatcher._allow_implicit_replication``): process-wide, like torch's.
_replicate = False


def replicate_plain_tensors(active: bool) -> bool:
    """Turn implicit replication on torch 2.1 on or off for every DTensor op; returns the previous
    state. ``implicit_replication()`` uses it; a patch that replicates automatically may set it
    once. It has no effect on torch >= 2.2, whose own switch is
    ``DTensor._op_dispatcher._allow_implicit_replication``."""
    global _replicate
    previous, _replicate = _replicate, bool(active)
    return previous


def _replicating_dispatch(wrapped: Callable[..., Any], instance: Any, args: Tuple[Any, ...],
                          kwargs: Dict[str, Any]) -> Any:
    """wrapt wrapper of torch 2.1's ``dispatch._operator_dispatch(op_call, args, kwargs, propagator)``:
    while replication is on, plain tensors among the op's arguments go in as replicated DTensors."""
    if not _replicate:
        return wrapped(*args, **kwargs)
    import torch
    from torch.distributed._tensor.api import DTensor
    from torch.distributed._tensor.placement_types import Replicate
    from torch.utils._pytree import tree_flatten, tree_unflatten

    op_call, op_args, op_kwargs, *rest = args
    flat, spec = tree_flatten((op_args, op_kwargs))
    mesh = next((a.device_mesh for a in flat if isinstance(a, DTensor)), None)
    if mesh is None or all(isinstance(a, DTensor) or not isinstance(a, torch.Tensor) for a in flat):
        return wrapped(*args, **kwargs)
    placements = (Replicate(),) * mesh.ndim

    def replicate(arg: Any) -> Any:
        if isinstance(arg, DTensor) or not isinstance(arg, torch.Tensor):
            return arg
        # The plain tensor is the local tensor on every rank, as torch >= 2.2 hands it in.
        return DTensor(arg, mesh, placements, shape=arg.shape, dtype=arg.dtype,
                       requires_grad=arg.requires_grad, stride=arg.stride())

    new_args, new_kwargs = tree_unflatten([replicate(a) for a in flat], spec)
    return wrapped(op_call, new_args, new_kwargs, *rest, **kwargs)


@PATCH.on_import("torch.distributed._tensor.dispatch")
def teach_dispatch(patcher: Patcher, dispatch: ModuleType) -> bool:
    # torch 2.1: module-level _operator_dispatch with the hard-coded check; 2.2+ has an OpDispatcher
    # with its own implicit replication.
    if not hasattr(dispatch, "_operator_dispatch") or hasattr(dispatch, "OpDispatcher"):
        return False
    patcher.wrap(dispatch, "_operator_dispatch", _replicating_dispatch)
    return True


def _dispatch_taught() -> bool:
    """Whether 2.1's ``_operator_dispatch`` has this patch's wrapper (under others' wrappers too)."""
    import torch.distributed._tensor.dispatch as dispatch

    fn = dispatch._operator_dispatch
    while fn is not None:
        if getattr(fn, "_self_wrapper", None) is _replicating_dispatch:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Within this context, DTensor ops treat plain ``torch.Tensor`` arguments as replicated on
    the DTensor's mesh (torch >= 2.2's ``implicit_replication``). That is only correct where the
    tensor really holds the same values on every rank."""
    if not _dispatch_taught():
        import torch

        raise RuntimeError(
            f"implicit_replication on torch {torch.__version__} (served by torchpatch) needs the "
            "dtensor-experimental patch of torch.distributed._tensor.dispatch, which is not in place"
        )
    previous = replicate_plain_tensors(True)
    try:
        yield
    finally:
        replicate_plain_tensors(previous)


def local_map(func: Callable[..., Any], out_placements: OutputPlacements,
              in_placements: InputPlacements = None, device_mesh: Any = None, *,
              redistribute_inputs: bool = False) -> Callable[..., Any]:
    """``func`` written for plain tensors, applied to DTensors (torch 2.4's ``local_map``): each
    DTensor argument is checked against (or, with ``redistribute_inputs``, redistributed to) its
    ``in_placements`` entry and passed as its local tensor; tensor outputs come back as DTensors
    with ``out_placements`` (one placement list, or a tuple of them for flattened outputs). Without
    DTensor arguments ``func``'s result is returned as it is."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        import torch
        import torch.distributed._functional_collectives as funcol
        from torch.distributed._tensor.api import DTensor
        from torch.utils._pytree import tree_flatten, tree_unflatten

        flat, spec = tree_flatten(args)
        if in_placements is not None and len(in_placements) != len(flat):
            raise AssertionError(f"in_placements length {len(in_placements)} does not match the "
                                 f"number of input args {len(flat)}!")
        mesh, seen_dtensor, local_args = device_mesh, False, []
        for idx, arg in enumerate(flat):
            if isinstance(arg, DTensor):
                seen_dtensor = True
                if mesh is None:
                    mesh = arg.device_mesh
                elif arg.device_mesh != mesh:
                    raise AssertionError(f"arg {arg} in local_map has a mismatched device mesh: "
                                         f"{arg.device_mesh}, expected {mesh}!")
                if in_placements is not None:
                    want = in_placements[idx]
                    if want is None:
                        raise AssertionError(f"DTensor input {arg} expects placements but received None!")
                    want = tuple(want)
                    if tuple(arg.placements) != want:
                        if not redistribute_inputs:
                            raise ValueError(
                                f"arg {arg} in local_map has a mismatched placements: arg placements is "
                                f"{tuple(arg.placements)} but the input placements is {want}! If "
                                "redistribute_inputs is wanted, set redistribute_inputs=True to local_map."
                            )
                        arg = arg.redistribute(mesh, want)
                local = arg.to_local()
                if isinstance(local, funcol.AsyncCollectiveTensor):
                    local = funcol.wait_tensor(local)
                local_args.append(local)
            else:
                want = in_placements[idx] if in_placements is not None else None
                if want is not None and not isinstance(arg, torch.Tensor):
                    raise AssertionError(f"Non-Tensor input {arg} expects None placements but received {want}!")
                local_args.append(arg)

        out = func(*tree_unflatten(local_args, spec), **kwargs)
        if not seen_dtensor:
            return out
        flat_out, out_spec = tree_flatten(out)
        dist_out = []
        for idx, value in enumerate(flat_out):
            placements = out_placements[idx] if isinstance(out_placements, tuple) else out_placements
            if isinstance(value, torch.Tensor):
                if isinstance(value, DTensor):
                    raise AssertionError(f"torch.Tensor output expected but received {type(value)}: {value}")
                dist_out.append(DTensor.from_local(value, mesh, placements, run_check=False))
            elif placements is not None:
                raise AssertionError(f"Non-tensor output {value} expects None placements but "
                                     f"received {placements}!")
            else:
                dist_out.append(value)
        return tree_unflatten(dist_out, out_spec)

    return wrapped


PATCH.sets("torch.distributed._tensor.experimental", ("implicit_replication",))


@PATCH.module("torch.distributed._tensor.experimental")
def build(module: ModuleType) -> None:
    module.implicit_replication = implicit_replication
    module.local_map = local_map
    module.__all__ = ["local_map", "implicit_replication"]


@PATCH.symbol("torch.distributed._tensor.experimental", "local_map")
def serve_local_map() -> Callable[..., Any]:
    return local_map

"""c10d-functional-ops: the ``torch.ops._c10d_functional`` collective ops (group-name schemas) on torch 2.1.

What breaks:   torchtitan keeps ``torch.ops._c10d_functional.reduce_scatter_tensor.default`` (and
               ``all_gather_into_tensor``, ``all_to_all_single``, ...) in a module-level set of ops to
               save for selective activation checkpointing, so on torch 2.1 its module dies at import
               with ``AttributeError: '_OpNamespace' '_c10d_functional' object has no attribute
               'reduce_scatter_tensor'``; code written for newer torch calls these ops as
               ``torch.ops._c10d_functional.all_reduce(t, "sum", group.group_name)`` and dies the same
               way (and on ``AttributeError: 'ProcessGroup' object has no attribute 'group_name'``).
Torch:         2.1 has only the Python-registered ``torch.ops.c10d_functional`` (no underscore), whose
               schemas take ``(tag, ranks, group_size)``; 2.2 brought the native ``_c10d_functional``
               namespace, whose ops name their process group by a string ``group_name``
               (``str group_name`` on 2.4, ``Any group_name`` on 2.13), and ``ProcessGroup.group_name``.
               1.13 has neither: nothing is served there.
Fix:           register real operators in the ``_c10d_functional`` namespace with torch.library, with
               the schemas of torch 2.4: ``all_reduce``, ``all_reduce_``, ``all_reduce_coalesced``,
               ``all_reduce_coalesced_``, ``all_gather_into_tensor``, ``all_gather_into_tensor_out``,
               ``all_gather_into_tensor_coalesced``, ``reduce_scatter_tensor``,
               ``reduce_scatter_tensor_coalesced``, ``all_to_all_single``, ``broadcast``,
               ``broadcast_`` and ``wait_tensor``, with a ``CompositeExplicitAutograd`` kernel (the
               dispatch key torch's own use), a ``Meta`` kernel (shapes only) and, for the
               differentiable ones, an ``Autograd`` kernel. Registered once torch
               is imported (torch 2.2+ has them from ``import torch`` on); taken back by
               ``torchpatch.uninstall()``. Behaviour:
               - ``group_name`` names a live process group by its c10d name: the default group is
                 ``"0"`` and each ``new_group`` (a DeviceMesh's groups, functional-collectives' groups
                 included) takes the next number, or a hash with ``use_local_synchronization`` —
                 torch 2.1 keeps these names in ``distributed_c10d._world.pg_names``, which is the
                 registry searched, and ``ProcessGroup.group_name`` is served to read it (newer code
                 passes ``group.group_name``; a group c10d did not make raises ``RuntimeError:
                 ProcessGroup name not set``, as on 2.13). A name no live group has raises ``RuntimeError: Could
                 not resolve the process group registered under the name ...`` as torch does.
               - Synchronous: each op finishes its collective before returning a new tensor (the
                 in-place and ``_out`` ops fill their argument); ``wait_tensor`` returns its argument,
                 as torch's does once the work is done. The computations are functional-collectives'
                 (same gloo detours: all_gather and reduce_scatter through all_gather/all_reduce,
                 ``"avg"`` as a sum and a division). ``broadcast``'s ``src`` is a rank in the group.
               - ``reduce_op``: "sum", "avg", "product", "min", "max", "band", "bor", "bxor", exact
                 case, as torch's; ``group_size`` must be the group's size.
               - Gradients as torch 2.13 defines them (once its functional collectives are imported):
                 all_reduce("sum") is its own backward, all_gather_into_tensor and
                 reduce_scatter_tensor("sum") are each other's (other reductions raise in backward;
                 torch 2.14 differentiates all_reduce("avg") too, 2.15 also "min" and "max"),
                 all_to_all_single swaps its splits, the coalesced ops differentiate tensor by tensor,
                 ``wait_tensor`` passes the gradient on. ``broadcast`` and the in-place ops have no
                 backward formula, as in torch 2.13: autograd passes their gradient through unchanged
                 (torch 2.4, which registers none for any of them, warns that this may be incorrect).
Upstream:      https://github.com/pytorch/pytorch/pull/110570 (native ``_c10d_functional`` ops, torch
               2.2); https://github.com/pytorch/pytorch/pull/113438 (``all_to_all_single``)
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Tuple

from torchpatch import Error, Patch, Patcher

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

NAMESPACE = "_c10d_functional"
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor")

PATCH = Patch(
    id="c10d-functional-ops",
    summary="torch.ops._c10d_functional collectives (group_name schemas of torch >= 2.2) and "
    "ProcessGroup.group_name",
    torch=">=2.1,<2.2",
    upstream="https://github.com/pytorch/pytorch/pull/110570",
    behaviour="13 torch.ops._c10d_functional ops registered (torch 2.4 schemas); ProcessGroup.group_name",
    errors=(
        Error(r"'_OpNamespace' '_c10d_functional' object has no attribute '\w+'",
              "AttributeError: '_OpNamespace' '_c10d_functional' object has no attribute 'reduce_scatter_tensor'"),
        Error(r"type object 'torch\._C\._distributed_c10d\.ProcessGroup' has no attribute 'group_name'",
              "AttributeError: type object 'torch._C._distributed_c10d.ProcessGroup' has no attribute 'group_name'"),
    ),
)


_libraries: Dict[str, Any] = {}  # namespace -> the torch.library.Library holding our registrations


# -- process groups by name -----------------------------------------------------------------------
def group_name(pg: "ProcessGroup") -> str:
    """The c10d name of ``pg`` (torch >= 2.2's ``ProcessGroup.group_name``)."""
    import torch.distributed.distributed_c10d as c10d

    name = c10d._world.pg_names.get(pg)
    if name is None:  # a group c10d did not make (or one destroyed since), as torch 2.13 says
        raise RuntimeError("ProcessGroup name not set")
    return name


def resolve_group(name: str) -> "ProcessGroup":
    """The live process group named ``name`` (torch >= 2.2's ``_resolve_process_group``)."""
    import torch.distributed.distributed_c10d as c10d

    for pg, pg_name in list(c10d._world.pg_names.items()):
        if pg_name == name:
            return pg
    raise RuntimeError(f"Could not resolve the process group registered under the name {name}")


def _check_reduce_op(reduce_op: str) -> None:
    if reduce_op not in REDUCE_OPS:
        raise RuntimeError(f"Unrecognized reduce_op: {reduce_op}")


def _check_group_size(op: str, group_size: int, pg: "ProcessGroup") -> None:
    if group_size != pg.size():
        raise RuntimeError(f"_c10d_functional.{op}: group_size {group_size} is not the size "
                           f"({pg.size()}) of the process group")


# -- kernels (CompositeExplicitAutograd) ------------------------------------------------------------
def all_reduce(input: "torch.Tensor", reduce_op: str, group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _all_reduce

    _check_reduce_op(reduce_op)
    return _all_reduce(input, reduce_op, resolve_group(group_name))


def all_reduce_(input: "torch.Tensor", reduce_op: str, group_name: str) -> "torch.Tensor":
    return input.copy_(all_reduce(input, reduce_op, group_name))


def all_reduce_coalesced(inputs: List["torch.Tensor"], reduce_op: str, group_name: str) -> List["torch.Tensor"]:
    return [all_reduce(t, reduce_op, group_name) for t in inputs]


def all_reduce_coalesced_(inputs: List["torch.Tensor"], reduce_op: str, group_name: str) -> List["torch.Tensor"]:
    return [all_reduce_(t, reduce_op, group_name) for t in inputs]


def all_gather_into_tensor(input: "torch.Tensor", group_size: int, group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _all_gather

    pg = resolve_group(group_name)
    _check_group_size("all_gather_into_tensor", group_size, pg)
    return _all_gather(input, pg)


def all_gather_into_tensor_out(input: "torch.Tensor", group_size: int, group_name: str, *,
                               out: "torch.Tensor") -> "torch.Tensor":
    gathered = all_gather_into_tensor(input, group_size, group_name)
    if out.shape != gathered.shape:
        raise RuntimeError(f"_c10d_functional.all_gather_into_tensor_out: out has shape {tuple(out.shape)}, "
                           f"the gathered tensor {tuple(gathered.shape)}")
    return out.copy_(gathered)


def all_gather_into_tensor_coalesced(inputs: List["torch.Tensor"], group_size: int,
                                     group_name: str) -> List["torch.Tensor"]:
    return [all_gather_into_tensor(t, group_size, group_name) for t in inputs]


def reduce_scatter_tensor(input: "torch.Tensor", reduce_op: str, group_size: int,
                          group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _reduce_scatter

    _check_reduce_op(reduce_op)
    pg = resolve_group(group_name)
    _check_group_size("reduce_scatter_tensor", group_size, pg)
    if input.dim() == 0 or input.shape[0] % group_size:
        raise RuntimeError(f"_c10d_functional.reduce_scatter_tensor: input dimension 0 "
                           f"({tuple(input.shape)}) must be divisible by group_size {group_size}")
    return _reduce_scatter(input, reduce_op, pg)


def reduce_scatter_tensor_coalesced(inputs: List["torch.Tensor"], reduce_op: str, group_size: int,
                                    group_name: str) -> List["torch.Tensor"]:
    return [reduce_scatter_tensor(t, reduce_op, group_size, group_name) for t in inputs]


def all_to_all_single(input: "torch.Tensor", output_split_sizes: List[int], input_split_sizes: List[int],
                      group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _all_to_all

    return _all_to_all(input, list(output_split_sizes), list(input_split_sizes), resolve_group(group_name))


def broadcast(input: "torch.Tensor", src: int, group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _broadcast

    return _broadcast(input, src, resolve_group(group_name))


def broadcast_(input: "torch.Tensor", src: int, group_name: str) -> "torch.Tensor":
    return input.copy_(broadcast(input, src, group_name))


def wait_tensor(tensor: "torch.Tensor") -> "torch.Tensor":
    return tensor


# -- Autograd kernels: torch 2.13's backward formulas ---------------------------------------------------
def _op(name: str) -> Any:
    import torch

    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _below_autograd(name: str, *args: Any) -> "torch.Tensor":
    """Run op ``name`` past this Autograd kernel (its CompositeExplicitAutograd or Meta kernel)."""
    import torch

    with torch._C._AutoDispatchBelowAutograd():
        return _op(name)(*args)


def all_reduce_autograd(input: "torch.Tensor", reduce_op: str, group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _apply, _sum_only

    return _apply(input, lambda t: _below_autograd("all_reduce", t, reduce_op, group_name),
                  _sum_only("all_reduce", reduce_op, lambda g: _op("all_reduce")(g, "sum", group_name)))


def all_gather_into_tensor_autograd(input: "torch.Tensor", group_size: int, group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _apply

    return _apply(input, lambda t: _below_autograd("all_gather_into_tensor", t, group_size, group_name),
                  lambda g: _op("reduce_scatter_tensor")(g, "sum", group_size, group_name))


def reduce_scatter_tensor_autograd(input: "torch.Tensor", reduce_op: str, group_size: int,
                                   group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _apply, _sum_only

    return _apply(input, lambda t: _below_autograd("reduce_scatter_tensor", t, reduce_op, group_size, group_name),
                  _sum_only("reduce_scatter_tensor", reduce_op,
                            lambda g: _op("all_gather_into_tensor")(g, group_size, group_name)))


def all_to_all_single_autograd(input: "torch.Tensor", output_split_sizes: List[int], input_split_sizes: List[int],
                               group_name: str) -> "torch.Tensor":
    from torchpatch.patches.collectives.functional_collectives import _apply

    out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)
    return _apply(input, lambda t: _below_autograd("all_to_all_single", t, out_splits, in_splits, group_name),
                  lambda g: _op("all_to_all_single")(g, in_splits, out_splits, group_name))


def _each(name: str) -> Callable[..., List["torch.Tensor"]]:
    """A coalesced op's Autograd kernel: the differentiable single op on each tensor."""
    def kernel(inputs: List["torch.Tensor"], *args: Any) -> List["torch.Tensor"]:
        return [_op(name)(t, *args) for t in inputs]

    return kernel


AUTOGRAD: Dict[str, Callable[..., Any]] = {
    "all_reduce": all_reduce_autograd,
    "all_gather_into_tensor": all_gather_into_tensor_autograd,
    "reduce_scatter_tensor": reduce_scatter_tensor_autograd,
    "all_to_all_single": all_to_all_single_autograd,
    "all_reduce_coalesced": _each("all_reduce"),
    "all_gather_into_tensor_coalesced": _each("all_gather_into_tensor"),
    "reduce_scatter_tensor_coalesced": _each("reduce_scatter_tensor"),
}


# -- Meta kernels: shapes only --------------------------------------------------------------------------
def _new(t: "torch.Tensor", rows: int) -> "torch.Tensor":
    return t.new_empty((rows,) + tuple(t.shape[1:]))


def _same(t: Any, *args: Any, **kwargs: Any) -> Any:
    return t


META: Dict[str, Callable[..., Any]] = {
    "all_reduce": lambda t, op, name: t.new_empty(t.shape),
    "all_reduce_": _same,
    "all_reduce_coalesced": lambda ts, op, name: [t.new_empty(t.shape) for t in ts],
    "all_reduce_coalesced_": _same,
    "all_gather_into_tensor": lambda t, size, name: _new(t, t.shape[0] * size),
    "all_gather_into_tensor_out": lambda t, size, name, *, out: out,
    "all_gather_into_tensor_coalesced": lambda ts, size, name: [_new(t, t.shape[0] * size) for t in ts],
    "reduce_scatter_tensor": lambda t, op, size, name: _new(t, t.shape[0] // size),
    "reduce_scatter_tensor_coalesced": lambda ts, op, size, name: [_new(t, t.shape[0] // size) for t in ts],
    "all_to_all_single": lambda t, out_splits, in_splits, name: _new(t, sum(out_splits)),
    "broadcast": lambda t, src, name: t.new_empty(t.shape),
    "broadcast_": _same,
    "wait_tensor": _same,
}

# torch 2.4's schemas, and the kernel of each op.
OPS: Dict[str, Tuple[str, Callable[..., Any]]] = {
    "all_reduce": ("(Tensor input, str reduce_op, str group_name) -> Tensor", all_reduce),
    "all_reduce_": ("(Tensor(a!) input, str reduce_op, str group_name) -> Tensor(a!)", all_reduce_),
    "all_reduce_coalesced": ("(Tensor[] inputs, str reduce_op, str group_name) -> Tensor[]", all_reduce_coalesced),
    "all_reduce_coalesced_": ("(Tensor[](a!) inputs, str reduce_op, str group_name) -> Tensor[](a!)",
                              all_reduce_coalesced_),
    "all_gather_into_tensor": ("(Tensor input, int group_size, str group_name) -> Tensor", all_gather_into_tensor),
    "all_gather_into_tensor_out": ("(Tensor input, int group_size, str group_name, *, Tensor(a!) out) -> Tensor(a!)",
                                   all_gather_into_tensor_out),
    "all_gather_into_tensor_coalesced": ("(Tensor[] inputs, int group_size, str group_name) -> Tensor[]",
                                         all_gather_into_tensor_coalesced),
    "reduce_scatter_tensor": ("(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor",
                              reduce_scatter_tensor),
    "reduce_scatter_tensor_coalesced": ("(Tensor[] inputs, str reduce_op, int group_size, str group_name) -> Tensor[]",
                                        reduce_scatter_tensor_coalesced),
    "all_to_all_single": ("(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, "
                          "str group_name) -> Tensor", all_to_all_single),
    "broadcast": ("(Tensor input, int src, str group_name) -> Tensor", broadcast),
    "broadcast_": ("(Tensor(a!) input, int src, str group_name) -> Tensor(a!)", broadcast_),
    "wait_tensor": ("(Tensor tensor) -> Tensor", wait_tensor),
}


PATCH.sets("torch.ops." + NAMESPACE, OPS)  # for ``torchpatch check``: register_ops makes them


@PATCH.on_import("torch")
def register_ops(patcher: Patcher, torch: ModuleType) -> bool:
    import torch.distributed as dist

    if not dist.is_available():
        return False
    missing = [name for name in OPS if not torch._C._dispatch_has_kernel(f"{NAMESPACE}::{name}")]  # ~1 µs each
    if missing:
        _libraries[NAMESPACE] = library = torch.library.Library(NAMESPACE, "FRAGMENT")

        def unregister() -> None:
            _libraries.pop(NAMESPACE, None)  # the last reference: the registrations go with it
            for name in missing:
                vars(getattr(torch.ops, NAMESPACE)).pop(name, None)  # cached op packets

        patcher.on_undo(unregister)
        for name in missing:
            schema, kernel = OPS[name]
            library.define(name + schema)
            library.impl(name, kernel, "CompositeExplicitAutograd")
            library.impl(name, META[name], "Meta")
            if name in AUTOGRAD:
                library.impl(name, AUTOGRAD[name], "Autograd")
    if not hasattr(dist.ProcessGroup, "group_name"):
        patcher.setattr(dist.ProcessGroup, "group_name", property(group_name, doc=group_name.__doc__))
    return patcher.changed

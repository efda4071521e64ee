"""funcol-autograd: gradients through the functional collectives (``all_reduce``,
``all_gather_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``), torch 2.4-2.12.

What breaks:   a model that calls ``torch.distributed._functional_collectives.all_reduce(x, "sum",
               group)`` (or reduce_scatter_tensor, all_to_all_single) on a tensor that requires grad
               trains on wrong gradients: the ``_c10d_functional`` ops have no autograd formula, so
               autograd's fallback passes the output gradient through unchanged (all_reduce: each
               rank gets its own gradient instead of the sum over ranks, with "max" or "min" instead
               of that sum on the ranks holding the extremum only; reduce_scatter: zeros for
               the chunks the rank did not keep) or drops it (all_to_all_single: ``x.grad`` stays
               None), with at most a UserWarning. Using the returned AsyncCollectiveTensor without
               ``.wait()`` cuts the graph as well: the wrapper is a leaf, so nothing reaches ``x``.
Torch:         2.4 (where ``torch.library.register_autograd`` arrived) to 2.12: no Autograd kernel
               for ``_c10d_functional::all_reduce`` and the others (asked of the dispatcher on
               2.4.1 and 2.9.0, reproduced there on gloo); torch 2.13 registers them (2.13.0,
               2.14.1, 2.15.0: the patch stays off). 2.2-2.3 have the same gap but no
               ``register_autograd`` (not patched). The formulas grew after 2.13: 2.13.0
               differentiates all_reduce only with "sum", 2.14.1 also with "avg", 2.15.0 with
               "sum", "avg", "premul_sum", "max" and "min" (the coalesced all_reduce with 2.13's
               and 2.14's only "sum", with 2.15's all five); reduce_scatter_tensor and its coalesced
               form only with "sum" in all three. Not patched: 2.13 and 2.14 refusing what 2.15
               differentiates (overriding torch's own registered kernel warns "Overriding a
               previously registered kernel" and its undo drops torch's entry from
               ``torch.library._impls``).
Fix:           where the dispatcher has no Autograd kernel for them, register torch 2.15.0's
               backward formulas (written here): all_reduce's and all_reduce_coalesced's with
               "sum", "avg" and "premul_sum" reduce the gradients with the same op; with "max" and
               "min" they sum them and split each element's sum evenly among the ranks whose input
               held the extremum (input equal to the output, or both NaN), the holders counted by
               an all_reduce("sum") of the masks in float32, the division done in the promoted
               dtype and cast back to the gradient's, zero elsewhere; any other reduction raises
               2.15's RuntimeError in its words (``all_reduce backward only supports `sum`,
               `premul_sum`, `avg`, `max`, `min` reductions, got 'product'``). (premul_sum cannot
               reach a backward on 2.4-2.12: the ops take the reduction as a string and refuse
               "premul_sum" in forward.) all_gather_into_tensor's is a reduce_scatter("sum"),
               reduce_scatter("sum")'s an all_gather (other reductions raise, as in 2.15),
               all_to_all_single's an all_to_all with the split sizes swapped;
               wait_tensor waits below autograd and returns its input, as the op does; and the AsyncCollectiveTensor of an output that requires
               grad is made with torch's own ``_FromTorchTensor`` (identity backward), as torch's
               ``*_autograd`` variants and 2.13's ``_wrap_tensor_autograd`` do. Kernels are
               registered on a Library fragment that undo destroys; a collective's kernel runs its
               autograd.Function only when grad is enabled and an input requires it (torch 2.4's
               ``register_autograd`` ran it on every call: the patch registers the kernel itself there). The coalesced ops
               (``all_reduce_coalesced``, ``all_gather_into_tensor_coalesced``,
               ``reduce_scatter_tensor_coalesced``) get 2.15's formulas too: each gradient goes
               through the coalesced op of the backward. A CPU collective whose input requires
               grad is waited for before its output joins the graph, or is saved for a max's or a
               min's backward: gloo's worker thread copies
               the result into the output (torch 2.4's all_gather into views of it), and that copy
               must not land on a tensor autograd already tracks. Natively torch 2.4 refuses it on
               whichever rank's copy came late ("A view was created in no_grad mode ..."), so one
               rank ran the backward's collective alone and gloo aborted; and its coalesced
               all_reduce of tensors that require grad crashes a rank with SIGSEGV inside the op
               now and then (2.4.1, 2 gloo ranks: at the 83rd and the 242nd of 6000 calls; with
               the patch, 6000 calls without one). (torch 2.15.0's own coalesced all_reduce("max")
               on gloo saves the outputs before that copy: its backward raises "one of the
               variables needed for gradient computation has been modified by an inplace
               operation" on some ranks and not others.)
Upstream:      https://github.com/pytorch/pytorch/pull/168140 (the formulas of torch 2.13; fixes
               https://github.com/pytorch/pytorch/issues/152131; the silent-gradient report:
               https://github.com/pytorch/pytorch/issues/152127); all_reduce("avg"), torch 2.14:
               https://github.com/pytorch/pytorch/pull/190224; premul_sum, max and min, torch 2.15:
               https://github.com/pytorch/pytorch/pull/190942
"""

from types import ModuleType
from typing import Any, Callable, Dict, List, Tuple

from torchpatch import Patch, Patcher

PATCH = Patch(
    id="funcol-autograd",
    summary="functional collectives differentiable (all_reduce sum/avg/max/min, all_gather, reduce_scatter sum, "
            "all_to_all_single, their coalesced forms) as in torch 2.15",
    torch=">=2.4,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/168140",
    behaviour="gradients of _c10d_functional collectives",
    category="correctness",
)

_NS = "_c10d_functional"


def _ops() -> Any:
    import torch

    return torch.ops._c10d_functional


def _waited(tensor: Any) -> Any:
    return _ops().wait_tensor(tensor)


# -- backward formulas (torch 2.15's semantics) -------------------------------------------------
# The reductions whose all_reduce (and all_reduce_coalesced) torch 2.15 differentiates: sum, avg and
# premul_sum reduce the gradients with the same op; max and min sum them and split each sum evenly
# among the ranks holding the extremum. (premul_sum is listed for the error's words only: the
# 2.4-2.12 ops refuse it in forward, "Unrecognized reduce_op: premul_sum".)
_DIFFERENTIABLE = ("sum", "avg", "premul_sum", "max", "min")
_EXTREMA = ("max", "min")
_REFUSED = "{} backward only supports `sum`, `premul_sum`, `avg`, `max`, `min` reductions, got '{}'"


def _all_reduce_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    """all_reduce's and all_reduce_coalesced's: max and min keep the inputs and the outputs."""
    tensors, reduce_op, ctx.group_name = inputs
    ctx.reduce_op = reduce_op.lower()
    if ctx.reduce_op in _EXTREMA:
        if isinstance(output, (list, tuple)):
            ctx.save_for_backward(*tensors, *output)
        else:
            ctx.save_for_backward(tensors, output)


def _only_sum(op: str, ctx: Any) -> None:
    """Refuse a backward through a reduction other than "sum", in torch 2.15's words (reduce_scatter)."""
    if ctx.reduce_op != "sum":
        raise RuntimeError(f"{op} backward only supports 'sum' reduction, got '{ctx.reduce_op}'")


def _split_among_holders(grads: List[Any], ctx: Any, coalesced: bool) -> List[Any]:
    """The summed gradients of a max or min, each element's split evenly among the ranks whose input
    held the extremum there (a NaN input holds a NaN output): the holders are counted with an
    all_reduce("sum") (coalesced for the coalesced op) of the masks in float32, so that a count stays
    exact in any gradient dtype; the division is done in the promoted dtype and cast back; elsewhere
    the gradient is zero."""
    saved = ctx.saved_tensors
    inputs, outputs = saved[:len(grads)], [_waited(t) for t in saved[len(grads):]]
    masks = [(x == y) | (x.isnan() & y.isnan()) for x, y in zip(inputs, outputs)]
    counts = [m.float() for m in masks]
    if not coalesced:
        counts = [_waited(_ops().all_reduce(counts[0], "sum", ctx.group_name))]
    else:
        counts = [_waited(t) for t in _ops().all_reduce_coalesced(counts, "sum", ctx.group_name)]
    return [(g / n).to(g.dtype).masked_fill(~m, 0) for g, m, n in zip(grads, masks, counts)]


def _all_reduce_backward(ctx: Any, grad: Any) -> Tuple[Any, None, None]:
    if ctx.reduce_op not in _DIFFERENTIABLE:
        raise RuntimeError(_REFUSED.format("all_reduce", ctx.reduce_op))
    extremum = ctx.reduce_op in _EXTREMA
    summed = _waited(_ops().all_reduce(grad.contiguous(), "sum" if extremum else ctx.reduce_op, ctx.group_name))
    return (_split_among_holders([summed], ctx, False)[0] if extremum else summed), None, None


def _all_gather_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    _, ctx.group_size, ctx.group_name = inputs


def _all_gather_backward(ctx: Any, grad: Any) -> Tuple[Any, None, None]:
    summed = _ops().reduce_scatter_tensor(grad.contiguous(), "sum", ctx.group_size, ctx.group_name)
    return _waited(summed), None, None


def _reduce_scatter_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    _, reduce_op, ctx.group_size, ctx.group_name = inputs
    ctx.reduce_op = reduce_op.lower()


def _reduce_scatter_backward(ctx: Any, grad: Any) -> Tuple[Any, None, None, None]:
    _only_sum("reduce_scatter_tensor", ctx)
    gathered = _ops().all_gather_into_tensor(grad.contiguous(), ctx.group_size, ctx.group_name)
    return _waited(gathered), None, None, None


def _all_to_all_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    _, ctx.output_split_sizes, ctx.input_split_sizes, ctx.group_name = inputs


def _all_to_all_backward(ctx: Any, grad: Any) -> Tuple[Any, None, None, None]:
    # the gradient travels back: what this rank received (output splits) it sends, and vice versa
    back = _ops().all_to_all_single(grad.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes, ctx.group_name)
    return _waited(back), None, None, None


def _all_reduce_coalesced_backward(ctx: Any, grads: List[Any]) -> Tuple[List[Any], None, None]:
    if ctx.reduce_op not in _DIFFERENTIABLE:
        raise RuntimeError(_REFUSED.format("all_reduce_coalesced", ctx.reduce_op))
    extremum = ctx.reduce_op in _EXTREMA
    summed = _ops().all_reduce_coalesced([g.contiguous() for g in grads], "sum" if extremum else ctx.reduce_op,
                                         ctx.group_name)
    summed = [_waited(t) for t in summed]
    return (_split_among_holders(summed, ctx, True) if extremum else summed), None, None


def _all_gather_coalesced_backward(ctx: Any, grads: List[Any]) -> Tuple[List[Any], None, None]:
    scattered = _ops().reduce_scatter_tensor_coalesced([g.contiguous() for g in grads], "sum", ctx.group_size,
                                                       ctx.group_name)
    return [_waited(t) for t in scattered], None, None


def _reduce_scatter_coalesced_backward(ctx: Any, grads: List[Any]) -> Tuple[List[Any], None, None, None]:
    _only_sum("reduce_scatter_tensor_coalesced", ctx)
    gathered = _ops().all_gather_into_tensor_coalesced([g.contiguous() for g in grads], ctx.group_size, ctx.group_name)
    return [_waited(t) for t in gathered], None, None, None


def _settled(setup: Callable[[Any, Tuple[Any, ...], Any], None]) -> Callable[[Any, Tuple[Any, ...], Any], None]:
    """For a CPU collective whose input requires grad, a wait for its result; then ``setup``.

    It runs inside the op's autograd Function, after the collective started and before the output
    is attached to the graph: gloo's worker thread then finishes writing the output while autograd
    does not track it yet (later, torch 2.4 refuses the copy into views of the gathered output, or
    an in-place copy would move the output's grad_fn), and before ``setup`` saves it (max, min).
    Without grad, or on CUDA, nothing waits.
    """

    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        outputs = output if isinstance(output, (list, tuple)) else [output]
        if any(ctx.needs_input_grad) and all(t.device.type == "cpu" for t in outputs):
            for tensor in outputs:
                _waited(tensor)  # below autograd here: the op's own kernel
        setup(ctx, inputs, output)

    return setup_context


class _Resolved:
    """What the per-collective kernels below call, looked up once when the patch applies."""

    wait: Any = None  # torch.ops._c10d_functional.wait_tensor.default
    no_grad: Any = None
    below_autograd: Any = None  # torch._C._AutoDispatchBelowAutograd
    grad_enabled: Any = None  # torch.is_grad_enabled
    tracing: Any = None  # funcol._are_we_tracing
    from_torch: Any = None  # funcol._FromTorchTensor.apply


def _wait_autograd(tensor: Any) -> Any:
    """wait_tensor's Autograd kernel: wait below autograd and without grad, hand back the input
    itself (the op returns its argument), so the gradient passes unchanged through the graph
    already there. (On torch 2.4 the wait of a gloo all_gather copies the result into the output,
    a view made without grad: with grad enabled autograd refuses that copy.)"""
    with _Resolved.no_grad(), _Resolved.below_autograd():
        _Resolved.wait(tensor)
    return tensor


_FORMULAS = {
    "all_reduce": (_all_reduce_backward, _all_reduce_setup),
    "all_gather_into_tensor": (_all_gather_backward, _all_gather_setup),
    "reduce_scatter_tensor": (_reduce_scatter_backward, _reduce_scatter_setup),
    "all_to_all_single": (_all_to_all_backward, _all_to_all_setup),
    "all_reduce_coalesced": (_all_reduce_coalesced_backward, _all_reduce_setup),
    "all_gather_into_tensor_coalesced": (_all_gather_coalesced_backward, _all_gather_setup),
    "reduce_scatter_tensor_coalesced": (_reduce_scatter_coalesced_backward, _reduce_scatter_setup),
}


def _connected_wrap(wrapped: Any, instance: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    """``_maybe_wrap_tensor(output)``: an output that requires grad gets its AsyncCollectiveTensor
    through ``_FromTorchTensor`` (identity backward), so the wrapper stays in the graph."""
    tensor = args[0] if args else next(iter(kwargs.values()))
    if getattr(tensor, "requires_grad", False) and _Resolved.grad_enabled() and not _Resolved.tracing():
        return _Resolved.from_torch(tensor)  # its forward calls _maybe_wrap_tensor under no_grad
    return wrapped(*args, **kwargs)


def _requires_grad(args: Tuple[Any, ...]) -> bool:
    for arg in args:
        if isinstance(arg, (list, tuple)):
            if any(getattr(t, "requires_grad", False) for t in arg):
                return True
        elif getattr(arg, "requires_grad", False):
            return True
    return False


def _register_skipping_without_grad(lib: Any, name: str, backward: Callable[..., Any],
                                    setup: Callable[..., Any]) -> bool:
    """What ``register_autograd`` registers, as torch 2.5+ runs it: the op's autograd.Function only
    when grad is enabled and an input requires it, else the op below autograd. (torch 2.4's kernel
    runs the Function on every call, each functional collective of a DTensor redistribution included.)
    False, registering nothing, where torch's pieces for it are not where 2.4 keeps them."""
    import torch

    try:
        from torch._library.autograd import Info, make_autograd_impl
    except ImportError:  # laid out otherwise: register_autograd's kernel as it is
        return False
    op = getattr(_ops(), name).default
    with_grad = make_autograd_impl(op, Info(backward, setup))
    after_autograd = torch._C._after_autograd_keyset

    def autograd_kernel(keyset: Any, *args: Any, **keyword_only: Any) -> Any:
        if _Resolved.grad_enabled() and _requires_grad(args):
            return with_grad(keyset, *args, **keyword_only)
        with _Resolved.below_autograd():
            return op.redispatch(keyset & after_autograd, *args, **keyword_only)

    lib.impl(name, autograd_kernel, "Autograd", with_keyset=True)
    return True


@PATCH.on_import("torch.distributed._functional_collectives")
def register_backward_formulas(patcher: Patcher, funcol: ModuleType) -> bool:
    import torch

    register = getattr(torch.library, "register_autograd", None)
    if register is None or not all(hasattr(funcol, n) for n in ("_FromTorchTensor", "_maybe_wrap_tensor", "_are_we_tracing")):
        return False  # torch < 2.4, or a module laid out unlike 2.4-2.12's
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    missing = [name for name in [*_FORMULAS, "wait_tensor"]
               if hasattr(_ops(), name) and not has_kernel(f"{_NS}::{name}", "Autograd")]
    if "all_reduce" not in missing:
        return False  # torch registers the formulas itself (2.13+)
    _Resolved.wait, _Resolved.no_grad = _ops().wait_tensor.default, torch.no_grad
    _Resolved.below_autograd, _Resolved.grad_enabled = torch._C._AutoDispatchBelowAutograd, torch.is_grad_enabled
    _Resolved.tracing, _Resolved.from_torch = funcol._are_we_tracing, funcol._FromTorchTensor.apply
    lib = torch.library.Library(_NS, "FRAGMENT")
    patcher.on_undo(lib._destroy)
    for name in missing:
        if name == "wait_tensor":
            lib.impl(name, _wait_autograd, "Autograd")
        else:
            backward, setup = _FORMULAS[name]
            # torch 2.4's register_autograd runs the autograd.Function on every call; 2.5+ skips it
            # without grad (torch._C._any_requires_grad).
            if hasattr(torch._C, "_any_requires_grad") or not _register_skipping_without_grad(
                    lib, name, backward, _settled(setup)):
                register(f"{_NS}::{name}", backward, setup_context=_settled(setup), lib=lib)
    patcher.wrap(funcol, "_maybe_wrap_tensor", _connected_wrap)
    return True

"""pipelining-split-weight-grad: the weight backward (``W``) of zero-bubble pipeline schedules gives
the gradients plain autograd gives, torch 2.5-2.12.

What breaks:   schedules that split a stage's backward into an input part (``I``) and a weight part
               (``W``): ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
               ``ScheduleDualPipeV``, CSV schedules with ``I``/``W``. ``stage_backward_weight``
               restarts autograd from the nodes where the weights meet the input's path, with the
               gradients saved during ``I``, and gets two things wrong, silently:
               - a node with several outputs that all get gradients (an LSTM whose output and
                 ``h_n`` are both used, ``broadcast_tensors`` of an activation and a parameter) gets
                 the *sum* of its output gradients on its first output;
               - a weight used at two places on one path (a layer applied twice, weights tied inside
                 a stage) gets the later use's gradient twice: once from the saved gradient, once
                 more through the earlier use.
               Measured on torch 2.9.0 against plain autograd (float64): a ``Linear`` applied
               twice, weight/bias gradients off by up to 0.77/0.38; an LSTM whose output and
               ``h_n`` are summed, ``weight_hh``/``bias_hh`` off by 0.017/0.35;
               ``ScheduleInterleavedZeroBubble`` on 2 ranks with such blocks: stages 1-3 differ
               (up to 0.024 on ``lin.bias``) while ScheduleInterleaved1F1B matches exactly.
               The input gradients (and so the activations' gradients between stages) are right;
               full-backward schedules (GPipe, 1F1B, Interleaved1F1B, LoopedBFS) are not affected.
Torch:         2.5 (the split came with torch 2.5) to 2.12: 2.9.0's ``stage_backward_weight`` seeds
               ``GradientEdge(intermediate, 0)`` with the summed gradients and adds no guard against
               double counting (read and reproduced on 2.9.0). #175705 (multi-output, 2026-02) and
               #181365 (shared weights, 2026-04) fixed it; torch 2.13.0 has both. The hook applies
               only where the installed ``stage_backward_weight`` still seeds output 0 only or has no
               pre-hook guard.
Fix:           ``torch.distributed.pipelining._backward.stage_backward_weight`` (and the name
               ``stage`` imported from it) is replaced: every output of an intermediate node that
               received a gradient in ``I`` is seeded with its own gradient, and while the weight
               gradients are computed a pre-hook on each intermediate of a group with several of
               them hands autograd the gradients saved in ``I``, so a path through a later
               intermediate does not add to an earlier one again. Same arguments, same return value
               (the weights' ``.grad`` before the call, as torch returns it), same accumulation into
               ``.grad``.
Upstream:      https://github.com/pytorch/pytorch/pull/175705 (issue #170277) and
               https://github.com/pytorch/pytorch/pull/181365 (issue #180952)
"""

from typing import Any, Dict, Iterable, List, Optional, Tuple

from torchpatch import Patch, Patcher
from torchpatch.patches._source import torch_source

PATCH = Patch(
    id="pipelining-split-weight-grad",
    summary="zero-bubble pipeline weight backward (stage_backward_weight): multi-output nodes and weights used twice",
    torch=">=2.5,<2.13",
    upstream="https://github.com/pytorch/pytorch/pull/181365",
    behaviour="ScheduleInterleavedZeroBubble / ZBV / DualPipeV weight gradients",
    category="correctness",
)


def stage_backward_weight(weights: Iterable[Any], param_groups: List[Dict[str, Any]],
                          retain_graph: bool = False) -> Tuple[Optional[Any], ...]:
    """Accumulate into each weight's ``.grad`` its gradient through the intermediates of
    ``param_groups`` (made by ``stage_backward_input``); returns the ``.grad`` values from before."""
    import torch
    from torch.autograd.graph import GradientEdge
    from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc

    weight_of: Dict[Any, Any] = {}
    before: List[Optional[torch.Tensor]] = []
    for weight in weights:
        weight_of[_get_grad_fn_or_grad_acc(weight)] = weight
        before.append(weight.grad)

    for group in param_groups:
        intermediates = group["intermediates"]
        saved = group.get("grads") or [None] * len(intermediates)
        roots, seeds = [], []
        for node, grads in zip(intermediates, saved):
            for index, grad in enumerate(grads or ()):
                if grad is not None:  # each output of the node gets its own gradient
                    roots.append(GradientEdge(node, index))
                    seeds.append(grad)
        handles = []
        try:
            if len(intermediates) > 1:
                # a node reached again through a later intermediate takes the gradient it had in I
                for node, grads in zip(intermediates, saved):
                    if grads is not None:
                        handles.append(node.register_prehook(lambda _grad_outputs, grads=grads: grads))
            del group["intermediates"]  # the hooks of stage_backward_input hold the group: break the cycle
            if roots:
                params = list(group["params"])
                dweights = torch.autograd.grad(roots, [GradientEdge(p, 0) for p in params],
                                               grad_outputs=seeds, retain_graph=retain_graph)
                group.pop("grads", None)
                for node, dw in zip(params, dweights):
                    weight = weight_of[node]
                    if weight.grad is None:
                        weight.grad = dw
                    else:
                        weight.grad += dw
        finally:
            for handle in handles:
                handle.remove()
    return tuple(before)


def _needs_fix(source: str) -> bool:
    """Whether the installed ``stage_backward_weight`` (its source) lacks one of the two fixes."""
    return "GradientEdge(intermediate, 0)" in source or "register_prehook" not in source


@PATCH.on_import("torch.distributed.pipelining.stage")
def route_weight_gradients(patcher: Patcher, stage: Any) -> bool:
    import torch.distributed.pipelining._backward as backward

    original = getattr(backward, "stage_backward_weight", None)
    if original is None:
        return False  # no split backward here
    source = torch_source(original)
    if '"intermediates"' not in source or not _needs_fix(source):
        return False  # no split backward here, or torch already routes the gradients right
    patcher.setattr(backward, "stage_backward_weight", stage_backward_weight)
    if getattr(stage, "stage_backward_weight", None) is original:
        patcher.setattr(stage, "stage_backward_weight", stage_backward_weight)
    return True

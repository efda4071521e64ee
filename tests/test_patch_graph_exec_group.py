"""graph-exec-group: ``torch.utils.checkpoint.GraphExecGroup`` on torch 2.4-2.9 as in torch 2.15.

A non-reentrant checkpointed region with two outputs, whose gradients two backward calls take apart
(as a pipeline schedule splitting input and weight gradients does): under one GraphExecGroup the region
is recomputed once, without it twice, and both gradients equal the derivatives computed from the
definition. Nesting groups, and two backward calls that need the same saved activation under one
group, raise torch 2.15's errors. The same script runs served (2.4, 2.9) and natively (2.13+).
"""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch
import torch.utils.checkpoint as cp
from torch.utils.checkpoint import GraphExecGroup

calls = []
def region(h):
    calls.append(1)
    return h.sin() * 2, h.cos() * 3

def run(grouped):
    x = torch.linspace(-1, 2, 5, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(0.5, 3, 5, dtype=torch.float64, requires_grad=True)
    a, b = cp.checkpoint(region, x * w, use_reentrant=False)
    calls.clear()
    with (GraphExecGroup() if grouped else torch.enable_grad()):
        gx, = torch.autograd.grad(a.sum(), x, retain_graph=True)
        gw, = torch.autograd.grad(b.sum(), w)
    h = (x * w).detach()
    close = torch.allclose(gx, 2 * h.cos() * w.detach(), rtol=1e-12) and \\
        torch.allclose(gw, -3 * h.sin() * x.detach(), rtol=1e-12)
    return {"recomputations": len(calls), "gradients_close": close}

out = {"grouped": run(True), "ungrouped": run(False), "module": GraphExecGroup.__module__}
with GraphExecGroup() as group:
    try:
        with GraphExecGroup():
            pass
    except RuntimeError as exc:
        out["nested"] = str(exc).replace(repr(group), "<group>")
out["after_nested"] = GraphExecGroup._get_current_group() is None
x = torch.linspace(0, 1, 3, dtype=torch.float64, requires_grad=True)
y = cp.checkpoint(lambda t: t.sin().sum(), x, use_reentrant=False)
with GraphExecGroup():
    torch.autograd.grad(y, x, retain_graph=True)
    try:
        torch.autograd.grad(y, x)
    except cp.CheckpointError as exc:
        out["overlap"] = str(exc)
print(json.dumps(out))
"""


@where_patch_applies("graph-exec-group")
def test_native_import_error():
    proc = run_py("from torch.utils.checkpoint import GraphExecGroup")
    assert "ImportError: cannot import name 'GraphExecGroup'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("graph-exec-group")
def test_one_recomputation_per_group():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["grouped"] == {"recomputations": 1, "gradients_close": True}
    assert out["ungrouped"] == {"recomputations": 2, "gradients_close": True}
    assert out["module"] == "torch.utils.checkpoint"
    assert out["nested"] == "GraphExecGroup contexts cannot be nested. Already inside group <group>"
    assert out["after_nested"] is True
    assert out["overlap"] == (
        "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already unpacked once. "
        "Performing two backward calls that overlap (i.e. require the same saved activation in order to "
        "compute gradients) is not allowed while under the torch.utils.checkpoint.GraphExecGroup context. "
        "If you are calling ctx.saved_tensors in backward, make sure to do so only once. Otherwise please "
        "open an issue with details on your use case.")

"""vmap-saved-tensor-hooks: ``torch.vmap`` under saved-tensor hooks on torch 2.4.

One process: a function that vmaps a mask (as FlexAttention's ``create_mask``) and a differentiable
product, inside a non-reentrant checkpoint and under ``saved_tensors_hooks`` that count what they
pack; its output and gradient must be those of the same function without checkpointing (the
reference), and ``torch.func.grad`` under hooks still refuses, as on torch 2.15, whose own run of the
same program is the expectation. Natively torch 2.4 refuses the vmap.
"""

from conftest import clean_env, patch_applies_here, run_json, run_newest_torch_json, through_patch_range, \
    where_patch_applies

PROGRAM = """
import json, torch
from torch.utils.checkpoint import checkpoint

def f(x):
    mask = torch.vmap(lambda i: (i % 2) == 0)(torch.arange(x.shape[0]))
    return (x.sin() * torch.vmap(lambda v: v * 3)(x) * mask).sum()

out = {}
x = torch.linspace(0.1, 1.0, 6, requires_grad=True)
ref = f(x)
ref_grad, = torch.autograd.grad(ref, x)
try:
    y = checkpoint(f, x, use_reentrant=False)
    grad, = torch.autograd.grad(y, x)
    out["checkpoint"] = [y.item() == ref.item(), torch.equal(grad, ref_grad)]
except RuntimeError as exc:
    out["checkpoint"] = str(exc)
packed = [0]
def pack(t):
    packed[0] += 1
    return t
try:
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = f(x)
    grad, = torch.autograd.grad(y, x)
    out["hooks"] = [y.item() == ref.item(), torch.equal(grad, ref_grad), packed[0] > 0]
except RuntimeError as exc:
    out["hooks"] = str(exc)
try:
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.func.grad(lambda v: v.sin().sum())(x.detach())
    out["grad"] = None
except RuntimeError as exc:
    out["grad"] = "refused" if "saved tensor hooks" in str(exc) else str(exc)
try:
    import torchpatch
    out["status"] = torchpatch.status().get("vmap-saved-tensor-hooks")
except ImportError:
    out["status"] = None
print(json.dumps(out))
"""


@where_patch_applies("vmap-saved-tensor-hooks", "torch 2.4's vmap refuses saved-tensor hooks")
def test_native_vmap_refuses_hooks():
    out = run_json(PROGRAM, env=clean_env())
    assert "torch.func transforms don't yet support saved tensor hooks" in out["checkpoint"], out
    assert "torch.func transforms don't yet support saved tensor hooks" in out["hooks"], out


@through_patch_range("vmap-saved-tensor-hooks", "vmap under saved-tensor hooks")
def test_vmap_under_hooks_equals_torch_2_15s():
    out = run_json(PROGRAM, env=clean_env(TORCHPATCH="1"))
    assert out.pop("status") == ("applied" if patch_applies_here("vmap-saved-tensor-hooks") else None)
    newest = run_newest_torch_json(PROGRAM)
    newest.pop("status")
    assert out == newest == {"checkpoint": [True, True], "hooks": [True, True, True], "grad": "refused"}, (out, newest)

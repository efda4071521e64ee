"""sdpa-enable-gqa: ``F.scaled_dot_product_attention(..., enable_gqa=True)`` on torch 2.4.

Natively 2.4 raises ``TypeError: ... unexpected keyword argument 'enable_gqa'``. With the patch, grouped
query attention (8 query heads over 2 key/value heads, a boolean mask, causal, a scale) and its
gradients equal this torch's own SDPA of key/value heads repeated as torch 2.15's reference does, and
torch 2.15's native output (run in its venv by the same test, same inputs) within float rounding;
heads that do not divide raise, as on 2.15.
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, where_patch_applies

SCRIPT = '''
import json, torch, torch.nn.functional as F
torch.manual_seed(0)
q = torch.randn(2, 8, 6, 4, requires_grad=True)
k, v = torch.randn(2, 2, 6, 4, requires_grad=True), torch.randn(2, 2, 6, 4, requires_grad=True)
mask = torch.rand(6, 6) > 0.3
mask.fill_diagonal_(True)
out = {}
for name, kw in {"mask": {"attn_mask": mask}, "causal": {"is_causal": True, "scale": 0.3}}.items():
    y = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    grads = torch.autograd.grad(y.sum(), (q, k, v))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, -3), v.repeat_interleave(4, -3), **kw)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    out[name] = {"y": y.tolist(), "grads": [g.tolist() for g in grads],
                 "own": torch.equal(y, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))}
try:
    F.scaled_dot_product_attention(q, torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4), enable_gqa=True)
    out["error"] = ""
except RuntimeError as exc:
    out["error"] = "RuntimeError"
print(json.dumps(out))
'''


@where_patch_applies("sdpa-enable-gqa", "torch 2.5 added enable_gqa")
def test_native_type_error():
    proc = run_py(SCRIPT)
    assert "unexpected keyword argument 'enable_gqa'" in proc.stderr, proc.stderr[-2000:]


def _close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return abs(a - b) <= 1e-5


@where_patch_applies("sdpa-enable-gqa")
def test_gqa_as_on_the_newest_torch():
    out, newest = run_json(SCRIPT, env=clean_env(TORCHPATCH="1")), run_newest_torch_json(SCRIPT)
    assert out["error"] == newest["error"] == "RuntimeError"
    for name in ("mask", "causal"):
        assert out[name]["own"], name
        assert _close(out[name]["y"], newest[name]["y"]) and _close(out[name]["grads"], newest[name]["grads"]), name

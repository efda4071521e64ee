"""sdpa-enable-gqa: ``F.scaled_dot_product_attention(..., enable_gqa=...)`` on torch 2.3-2.4.

Natively 2.4 raises ``TypeError: ... unexpected keyword argument 'enable_gqa'``. With the patch, grouped
query attention (8 query heads over 2 key/value heads, a boolean mask, causal, a scale) and its
gradients equal (within 1e-6: torch's own GQA adds the key/value gradients' group sums in another order)
this torch's own SDPA of key/value heads repeated as torch 2.15's reference does, and
torch 2.15's native output (run in its venv by the same test, same inputs) within float rounding;
``enable_gqa`` with equal heads and ``enable_gqa=False`` are bit-equal to the call without it, and query,
key and value given by name to those given by position; heads that do not divide raise 2.15's
``RuntimeError``. Through the patch's range and torch's own ``enable_gqa`` from 2.5 the same script
holds.
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, through_patch_range, where_patch_applies

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
                 "own": max((a - b).abs().max().item() for a, b in zip([y] + list(grads), [ref] + list(ref_grads)))}

def attend(*args, **kw):
    y = F.scaled_dot_product_attention(*args, **kw)
    return [y] + list(torch.autograd.grad(y.sum(), (q,)))

plain = attend(q, q, q, is_causal=True)
same_heads = [attend(q, q, q, is_causal=True, **kw) for kw in ({"enable_gqa": True}, {"enable_gqa": False})]
out["same_heads_equal"] = all(torch.equal(a, b) for o in same_heads for a, b in zip(o, plain))
by_keyword = attend(query=q, key=k, value=v, is_causal=True, enable_gqa=True)
by_position = attend(q, k, v, is_causal=True, enable_gqa=True)
out["by_keyword_equal"] = all(torch.equal(a, b) for a, b in zip(by_keyword, by_position))
try:
    F.scaled_dot_product_attention(q, torch.randn(2, 3, 6, 4), torch.randn(2, 3, 6, 4), enable_gqa=True)
    out["error"] = ""
except RuntimeError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
'''
# torch 2.15's text (2.9's ends "...heads in ")
ERROR = "Number of heads in key and value must divide the number of heads in"


@where_patch_applies("sdpa-enable-gqa", "torch 2.5 added enable_gqa")
def test_native_type_error():
    proc = run_py(SCRIPT)
    assert "unexpected keyword argument 'enable_gqa'" in proc.stderr, proc.stderr[-2000:]


def _close(a, b) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return abs(a - b) <= 1e-5


@through_patch_range("sdpa-enable-gqa", "torch's own enable_gqa from 2.5")
def test_grouped_query_attention_as_repeated_heads():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["error"].startswith(ERROR), out["error"]
    assert out["mask"]["own"] <= 1e-6 and out["causal"]["own"] <= 1e-6, (out["mask"]["own"], out["causal"]["own"])
    assert out["same_heads_equal"] and out["by_keyword_equal"], out


@where_patch_applies("sdpa-enable-gqa")
def test_gqa_as_on_the_newest_torch():
    out, newest = run_json(SCRIPT, env=clean_env(TORCHPATCH="1")), run_newest_torch_json(SCRIPT)
    assert out["error"].startswith(ERROR) and newest["error"].startswith(ERROR), (out["error"], newest["error"])
    for name in ("mask", "causal"):
        assert _close(out[name]["y"], newest[name]["y"]) and _close(out[name]["grads"], newest[name]["grads"]), name

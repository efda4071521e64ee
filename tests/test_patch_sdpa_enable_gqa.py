"""sdpa-enable-gqa: ``F.scaled_dot_product_attention(..., enable_gqa=...)`` on torch 2.4 (2.3-2.4 lack the
keyword). One script, served where the patch applies and torch's own from 2.5: with 4 query heads and 2
key/value heads the output is bit-equal to attention over ``repeat_interleave``d keys and values computed
in the same run (torch 2.15's native GQA is that too) and the gradients equal within 1e-6; ``enable_gqa``
with equal heads, and ``enable_gqa=False``, are bit-equal to the call without it; 3 key/value heads raise
torch 2.15's ``RuntimeError``. Natively on 2.4 the keyword is a ``TypeError``."""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch, torch.nn.functional as F
torch.manual_seed(0)
q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)

def attend(q, k, v, repeat=False, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(2, -3) for t in (k, v)) if repeat else (k, v)
    out = F.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)
    out.sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]

gqa, reference = attend(q, k, v, enable_gqa=True), attend(q, k, v, repeat=True)
same_heads = [attend(q, q, q, **kw) for kw in ({}, {"enable_gqa": True}, {"enable_gqa": False})]
try:
    F.scaled_dot_product_attention(q, torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8), enable_gqa=True)
    error = None
except RuntimeError as exc:
    error = str(exc)
print(json.dumps({
    "out_equal": torch.equal(gqa[0], reference[0]),
    "grads_close": all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(gqa[1], reference[1])),
    "same_heads_equal": all(torch.equal(o[0], same_heads[0][0]) and all(torch.equal(a, b) for a, b in zip(o[1], same_heads[0][1]))
                            for o in same_heads[1:]),
    "error": error}))
"""


@where_patch_applies("sdpa-enable-gqa", "torch 2.5 added enable_gqa")
def test_native_type_error():
    proc = run_py("import torch, torch.nn.functional as F\nq = torch.randn(1, 2, 3, 4)\n"
                  "F.scaled_dot_product_attention(q, q, q, enable_gqa=False)\n")
    assert "unexpected keyword argument 'enable_gqa'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("sdpa-enable-gqa", "torch's own enable_gqa from 2.5")
def test_grouped_query_attention_as_repeated_heads():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    error = out.pop("error")
    assert out == {"out_equal": True, "grads_close": True, "same_heads_equal": True}, out
    # 2.15's text (2.9's ends "...heads in ")
    assert error is not None and error.startswith("Number of heads in key and value must divide the number of heads in"), error

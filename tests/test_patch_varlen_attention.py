"""varlen-attention: ``torch.nn.attention.varlen`` on torch 2.4-2.9 (and ``varlen_attn_out`` on 2.10-2.11)
with torch 2.15's semantics.

On this machine (CPU): the same script, served (2.4, 2.9) and native (2.15), gives the same module
names, the same argument errors, the same backend errors for each ``sdpa_kernel`` choice (the
dispatcher's "Could not run 'aten::_flash_attention_forward' with arguments from the 'CPU' backend",
2.15's "No viable backend" and its list of unmet cuDNN constraints) and on meta tensors the same
output shapes. On a CUDA machine the values test compares output, logsumexp and gradients with the
attention computed from the definition in float64, sequence by sequence (sliding windows aligned to
the bottom right, grouped-query heads, paged KV with ``seqused_k``): fp16 inputs, so the tolerance is
a few fp16 roundings of values of order one. torch 2.10-2.14's own ``varlen_attn`` predates 2.15's
scale check, backend choice and meta shapes: those are checked where the module is served (2.4-2.9) and
from 2.15.
"""

import pytest

from conftest import clean_env, only_torch, run_json, run_py, through_patch_range, torch_matches

CHECKS = """
import json, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.varlen import AuxRequest, varlen_attn, varlen_attn_out
import torch.nn.attention.varlen as module

def error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return [type(exc).__name__, str(exc).split(" This could be")[0]]

g = torch.Generator().manual_seed(0)
q, kv = torch.randn(7, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g)
cu = torch.tensor([0, 3, 7], dtype=torch.int32)
out = {"all": sorted(module.__all__), "aux": [AuxRequest()._asdict(), AuxRequest._fields],
       "module": [varlen_attn.__module__, AuxRequest.__module__, varlen_attn_out.__module__],
       "cpu": error(varlen_attn, q, q, q, cu, cu, 4, 4),
       "cpu_gqa_lse": error(varlen_attn, q, kv, kv, cu, cu, 4, 4, enable_gqa=True, return_aux=AuxRequest(lse=True)),
       "cpu_out": error(varlen_attn_out, torch.empty_like(q), q, q, q, cu, cu, 4, 4),
       "heads": error(varlen_attn, q, kv, kv, cu, cu, 4, 4),
       "gqa": error(varlen_attn, q, q[:, :3], q[:, :3], cu, cu, 4, 4, enable_gqa=True),
       "scale": error(varlen_attn, q, q, q, cu, cu, 4, 4, scale=-1.0),
       "window": error(varlen_attn, q, q, q, cu, cu, 4, 4, window_size=(1, 2, 3))}
with sdpa_kernel(SDPBackend.MATH):
    out["math_only"] = error(varlen_attn, q, q, q, cu, cu, 4, 4)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    out["cudnn_only"] = error(varlen_attn, q, q, q, cu, cu, 4, 4)
    h = torch.randn(7, 2, 12, dtype=torch.bfloat16, requires_grad=True)
    out["cudnn_causal"] = error(varlen_attn, h, h, h, cu, cu.clone(), 200, 200, window_size=(-1, 0), num_splits=2)
    h8 = h.detach()[:, :, :8].contiguous()
    out["cudnn_window"] = error(varlen_attn, h8, h8, h8, cu, cu, 200, 200, window_size=(3, 0))
m, mcu = q.to("meta"), cu.to("meta")
shapes = [*varlen_attn(m, m, m, mcu, mcu, 4, 4, return_aux=AuxRequest(lse=True)),
          varlen_attn(m, m, torch.empty(7, 4, 16, device="meta"), mcu, mcu, 4, 4)]
out["meta"] = [[list(t.shape), str(t.dtype), t.device.type] for t in shapes]
print(json.dumps(out))
"""

VALUES = """
import json, torch
from torch.nn.attention.varlen import AuxRequest, varlen_attn, varlen_attn_out

def reference(q, k, v, lens_q, lens_k, window, scale):
    outs, lses, start_q, start_k = [], [], 0, 0
    for lq, lk in zip(lens_q, lens_k):
        qi, ki, vi = q[start_q:start_q + lq], k[start_k:start_k + lk], v[start_k:start_k + lk]
        ki, vi = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (ki, vi))
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        i, j = torch.arange(lq)[:, None] + (lk - lq), torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if window[0] >= 0:
            allowed &= j >= i - window[0]
        if window[1] >= 0:
            allowed &= j <= i + window[1]
        s = s.masked_fill(~allowed.to(s.device), float("-inf"))
        lses.append(s.logsumexp(-1))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vi))
        start_q, start_k = start_q + lq, start_k + lk
    return torch.cat(outs), torch.cat(lses, dim=1)

def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()

g = torch.Generator(device="cuda").manual_seed(0)
lens_q, lens_k = [5, 17, 1, 9], [5, 17, 4, 12]
def packed(lens, heads):
    return torch.randn(sum(lens), heads, 64, device="cuda", dtype=torch.float16, generator=g)
def cumulative(lens):
    return torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
q, k, v = packed(lens_q, 4), packed(lens_k, 2), packed(lens_k, 2)
out = {}
for window in [(-1, -1), (-1, 0), (3, 0), (2, 1)]:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = varlen_attn(*leaves, cumulative(lens_q), cumulative(lens_k), max(lens_q), max(lens_k),
                         return_aux=AuxRequest(lse=True), window_size=window, enable_gqa=True, scale=0.2)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ro, rlse = reference(*ref_leaves, lens_q, lens_k, window, 0.2)
    grads = torch.autograd.grad((o.double() * ro.detach().cos()).sum(), leaves)
    ref_grads = torch.autograd.grad((ro * ro.detach().cos()).sum(), ref_leaves)
    finite = torch.isfinite(rlse)
    out[str(window)] = {"out": rel(o, ro), "lse": (lse[finite].double() - rlse[finite]).abs().max().item(),
                        "grads": max(rel(a, b) for a, b in zip(grads, ref_grads))}
# paged KV: pages of 4 tokens, sequence i's pages listed in block_table[i], seqused_k valid tokens
pages = [[2, 0, 5], [1, 3, 4]]
kp, vp = torch.randn(2, 6, 4, 2, 64, device="cuda", dtype=torch.float16, generator=g)
used, lq = [7, 10], [3, 2]
with torch.no_grad():
    o = varlen_attn(q[:5], kp, vp, cumulative(lq), None, 3, 10, block_table=torch.tensor(pages, device="cuda",
                    dtype=torch.int32), seqused_k=torch.tensor(used, device="cuda", dtype=torch.int32), enable_gqa=True)
    flat = [torch.cat([t[p] for p in row])[:n] for t in (kp, vp) for row, n in zip(pages, used)]
    ro, _ = reference(q[:5].double(), torch.cat(flat[:2]).double(), torch.cat(flat[2:]).double(), lq, used,
                      (-1, -1), 64 ** -0.5)
    buffer = torch.empty_like(q)
    written = varlen_attn_out(buffer, q, k, v, cumulative(lens_q), cumulative(lens_k), 17, 17, enable_gqa=True)
    ro2, _ = reference(q.double(), k.double(), v.double(), lens_q, lens_k, (-1, -1), 64 ** -0.5)
out["paged"] = rel(o, ro)
out["out_variant"] = [written is buffer, rel(buffer, ro2)]
print(json.dumps(out))
"""


@only_torch(">=2.4,<2.10", "no torch.nn.attention.varlen before 2.10")
def test_native_module_not_found():
    proc = run_py("import torch.nn.attention.varlen")
    assert "No module named 'torch.nn.attention.varlen'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("varlen-attention")
def test_errors_and_shapes_as_torch_2_15():
    out = run_json(CHECKS, env=clean_env(TORCHPATCH="1"))
    assert out["all"] == ["AuxRequest", "varlen_attn", "varlen_attn_out"]
    assert out["aux"] == [{"lse": False}, ["lse"]]
    assert out["module"] == ["torch.nn.attention.varlen"] * 3
    cpu = "Could not run 'aten::_flash_attention_forward{}' with arguments from the 'CPU' backend."
    assert out["cpu"] == out["cpu_gqa_lse"] == ["NotImplementedError", cpu.format("")]
    assert out["cpu_out"] == ["NotImplementedError", cpu.format("_no_dropout_inplace")]
    assert out["heads"] == ["ValueError", "Expect query and key/value to have the same number of heads but got "
                                          "Hq=4 and Hkv=2. Try setting enable_gqa=True for GQA."]
    assert out["gqa"] == ["ValueError", "Expect number of query heads to be a multiple of kv heads for GQA but "
                                        "got Hq=4 and Hkv=3."]
    assert out["window"] == ["ValueError", "window_size must have length 2, got 3"]
    if not (torch_matches("<2.10") or torch_matches(">=2.15")):
        return  # torch 2.10-2.14's own varlen_attn: always flash, no scale check
    assert out["scale"] == ["ValueError", "scale must be greater than 0, got -1.0"]
    assert out["math_only"] == ["RuntimeError", "No viable backend for varlen_attn. Enable "
                                "SDPBackend.FLASH_ATTENTION or SDPBackend.CUDNN_ATTENTION with sdpa_kernel()."]
    unmet = "SDPBackend.CUDNN_ATTENTION was requested for varlen_attn, but its constraints are not satisfied:"
    assert out["cudnn_only"] == ["RuntimeError", "\n  - ".join([
        unmet, "query must be on CUDA", "max_q <= 128 requires cuDNN >= 9.24",
        "query dtype must be float16 or bfloat16"])]
    assert out["cudnn_causal"] == ["RuntimeError", "\n  - ".join([
        unmet, "query must be on CUDA", "query and value head dimensions must be divisible by 8",
        "causal attention requires seqused_k or the same cu_seq tensor for Q and K", "num_splits is not supported"])]
    assert out["cudnn_window"] == ["RuntimeError", "\n  - ".join([
        unmet, "query must be on CUDA", "window_size must be (-1, -1) or causal (-1, 0)"])]
    assert out["meta"] == [[[7, 4, 8], "torch.float32", "meta"], [[4, 7], "torch.float32", "meta"],
                           [[7, 4, 16], "torch.float32", "meta"]]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


@pytest.mark.skipif(not _cuda(), reason="flash attention needs a CUDA GPU of compute capability 8.0+")
@through_patch_range("varlen-attention")
def test_values_on_cuda():
    out = run_json(VALUES, env=clean_env(TORCHPATCH="1"))
    for window in ("(-1, -1)", "(-1, 0)", "(3, 0)", "(2, 1)"):
        assert out[window]["out"] < 2e-3 and out[window]["lse"] < 2e-3 and out[window]["grads"] < 1e-2, out
    assert out["paged"] < 2e-3 and out["out_variant"][0] is True and out["out_variant"][1] < 2e-3, out

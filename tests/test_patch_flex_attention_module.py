"""flex-attention-module: ``torch.nn.attention.flex_attention`` on torch 2.4 (public since 2.5),
computing what torch 2.15's eager FlexAttention computes. One script runs on every torch from 2.4 (served
on 2.4, torch's own module from 2.5, so torch 2.15 validates each expectation); it checks, in float32
against a float64 reference written out from the definition (masked softmax attention) in the run:
outputs and logsumexp with no mod, a causal block mask, score_mods (relative position bias from a
captured table, tanh soft-cap), a document mask (``and_masks``), GQA, a row that attends to nothing;
gradients wrt q/k/v where the torch computes them on CPU (torch 2.15 raises there: so does the served
module, whose gradients are checked through the computation it runs); and ``create_block_mask``'s
``kv_num_blocks``/``full_kv_num_blocks``/``to_dense()``/``sparsity()`` against the blocks counted in the
run. Natively on 2.4 the import fails; from 2.5 the module is torch's own."""

import pytest
from conftest import (clean_env, import_with_torchpatch, only_torch, run_json, run_py, through_patch_range,
                      torch_matches, where_patch_applies)

IMPORT = "from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention"


@where_patch_applies("flex-attention-module", "torch 2.4 has only the private _flex_attention")
def test_native_module_not_found():
    proc = run_py(IMPORT)
    assert "ModuleNotFoundError: No module named 'torch.nn.attention.flex_attention'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = r"""
import inspect, json, math, warnings
import torch, torchpatch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention  # torchtitan 0.1.0
from torch.nn.attention.flex_attention import AuxRequest, and_masks, create_mask, noop_mask, or_masks
import torch.nn.attention.flex_attention as module

warnings.simplefilter("ignore")
SERVED = torchpatch.status().get("flex-attention-module") == "applied"
EPS = torch.finfo(torch.float32).eps
B, HQ, HKV, L, E = 2, 4, 2, 40, 16
torch.manual_seed(0)
q, k, v = (torch.randn(B, HQ, L, E) for _ in range(3))
k2, v2 = torch.randn(B, HKV, L, E), torch.randn(B, HKV, L, E)
docs = torch.tensor([0] * 13 + [1] * 17 + [2] * 10)
bias = torch.randn(HQ, 2 * L - 1)
i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
hh = torch.arange(HQ)[:, None, None]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def same_doc(b, h, q_idx, kv_idx):
    return docs[q_idx] == docs[kv_idx]


def no_row_7(b, h, q_idx, kv_idx):  # query 7 attends to nothing
    return (q_idx != 7) & (q_idx >= kv_idx)


def rel_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h, q_idx - kv_idx + L - 1]


def soft_cap(score, b, h, q_idx, kv_idx):
    return 1.5 * torch.tanh(score / 1.5)


def reference(q, k, v, allowed, score=None):
    # float64, written out: kv heads repeated for GQA, scores q k^T / sqrt(E), score applied, masked
    # entries -inf, softmax (a row with nothing allowed: output 0, logsumexp -inf)
    q, k, v = q.double(), k.double(), v.double()
    k, v = k.repeat_interleave(q.size(1) // k.size(1), 1), v.repeat_interleave(q.size(1) // k.size(1), 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    s = score(s) if score is not None else s
    s = s.masked_fill(~allowed, -math.inf)
    row_max = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    e = (s - row_max).exp()
    total = e.sum(-1, keepdim=True)
    out = (e / total.clamp_min(1e-300)) @ v
    return out, (row_max + total.log()).squeeze(-1)


def error_ratio(got, want, terms):
    # float32 rounding: a value sums `terms` products, each rounded to EPS relative; 4x for the steps chained
    tol = 4 * terms * EPS * max(1.0, want.abs().max().item())
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(want[~finite], got[~finite].double()):
        return "non-finite entries differ"
    return (got.double()[finite] - want[finite]).abs().max().item() / tol


ALL = torch.ones(L, L, dtype=torch.bool)
DOC = (docs[:, None] == docs[None, :]) & (i >= j)
cases = {  # name: (flex_attention kwargs, allowed, reference score, k, v)
    "no_mod": ({}, ALL, None, k, v),
    "causal": ({"block_mask": create_block_mask(causal, None, None, L, L, device="cpu", BLOCK_SIZE=16)}, i >= j,
               None, k, v),
    "rel_bias": ({"score_mod": rel_bias}, ALL, lambda s: s + bias[hh, i - j + L - 1], k, v),
    "soft_cap_causal": ({"score_mod": soft_cap, "block_mask": create_block_mask(causal, 1, 1, L, L, "cpu", 8)},
                        i >= j, lambda s: 1.5 * torch.tanh(s / 1.5), k, v),
    "document": ({"block_mask": create_block_mask(and_masks(causal, same_doc), B, HQ, L, L, "cpu", 16)}, DOC,
                 None, k, v),
    "gqa_causal": ({"enable_gqa": True, "block_mask": create_block_mask(causal, B, None, L, L, "cpu", 16)}, i >= j,
                   None, k2, v2),
    "empty_row": ({"block_mask": create_block_mask(no_row_7, None, None, L, L, "cpu", 16)}, (i != 7) & (i >= j),
                  None, k, v),
}
out = {"forward": {}}
for name, (kwargs, allowed, score, kk, vv) in cases.items():
    got, lse = flex_attention(q, kk, vv, return_lse=True, **kwargs)
    want, want_lse = reference(q, kk, vv, allowed.expand(B, HQ, L, L), score)
    out["forward"][name] = {"out": error_ratio(got, want, E + L), "lse": error_ratio(lse, want_lse, E + L),
                            "shape": list(got.shape), "dtypes": [str(got.dtype), str(lse.dtype)]}
got = flex_attention(q, k, v, block_mask=cases["empty_row"][0]["block_mask"], return_lse=True)
out["empty_row"] = {"out_zero": bool((got[0][:, :, 7] == 0).all()), "lse": got[1][:, :, 7].unique().tolist()}
aux = flex_attention(q, k, v, score_mod=soft_cap, return_aux=AuxRequest(lse=True))
plain, lse = flex_attention(q, k, v, score_mod=soft_cap, return_lse=True)
out["aux"] = [torch.equal(aux[0], plain), torch.equal(aux[1].lse, lse), aux[1].max_scores]


def error(fn):
    try:
        fn()
    except (NotImplementedError, ValueError, RuntimeError) as exc:
        return [type(exc).__name__, str(exc)]
    return None


out["errors"] = {
    "max_scores_cpu": error(lambda: flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True))),
    "lse_and_aux": error(lambda: flex_attention(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))),
    "heads": error(lambda: flex_attention(q, k2, v2)),
    "mask_too_small": error(lambda: flex_attention(q, k, v, block_mask=create_block_mask(causal, 1, 1, 20, 20, "cpu"))),
}

# gradients of sum(out * w) wrt q, k, v
w = torch.randn(B, HQ, L, E)
grad_cases = {"gqa_causal_soft_cap": ({"enable_gqa": True, "score_mod": soft_cap, "block_mask":
                                       create_block_mask(causal, None, None, L, L, "cpu", 16)}, i >= j,
                                      lambda s: 1.5 * torch.tanh(s / 1.5), k2, v2),
              "document_empty_row": ({"block_mask": create_block_mask(and_masks(same_doc, no_row_7), B, 1, L, L, "cpu",
                                                                      8)}, DOC & (i != 7), None, k, v)}
out["backward"], out["served_backward"] = {}, {}
for name, (kwargs, allowed, score, kk, vv) in grad_cases.items():
    leaves = [t.clone().requires_grad_() for t in (q, kk, vv)]
    wants = [t.double().requires_grad_() for t in (q, kk, vv)]
    (reference(*wants, allowed.expand(B, HQ, L, L), score)[0] * w).sum().backward()
    public = error(lambda: (flex_attention(*leaves, **kwargs) * w).sum().backward())
    if public is None:  # this torch computes gradients on CPU
        out["backward"][name] = [error_ratio(t.grad, want.grad, 4 * (E + L)) for t, want in zip(leaves, wants)]
    else:
        out["backward"][name] = public
    if SERVED:  # the computation the served flex_attention runs once its inputs are checked (on CUDA, say)
        from torchpatch.patches.attention._flex.attention import _attention
        from torchpatch.patches.attention._flex.mods import _identity

        leaves = [t.clone().requires_grad_() for t in (q, kk, vv)]
        (_attention(*leaves, kwargs.get("score_mod", _identity), kwargs["block_mask"], E ** -0.5)[0]
         * w).sum().backward()
        out["served_backward"][name] = [error_ratio(t.grad, want.grad, 4 * (E + L)) for t, want in zip(leaves, wants)]


# BlockMask of a causal mask against the blocks counted here: a block is present where some (q, kv) in it
# has q >= kv, full where it is whole (not cut by the sequence end) and every (q, kv) in it has q >= kv
def count_blocks(Q, KV, bq, bkv):
    rows, cols = -(-Q // bq), -(-KV // bkv)
    partial, full = [[0] * cols for _ in range(rows)], [[0] * cols for _ in range(rows)]
    for r in range(rows):
        for c in range(cols):
            qs, kvs = range(r * bq, min(r * bq + bq, Q)), range(c * bkv, min(c * bkv + bkv, KV))
            allowed = [qi >= ki for qi in qs for ki in kvs]
            whole = len(qs) == bq and len(kvs) == bkv
            full[r][c] = int(whole and all(allowed))
            partial[r][c] = int(any(allowed) and not full[r][c])
    return partial, full


out["block_masks"] = []
for Q, KV, block in [(64, 64, 16), (100, 100, 32), (96, 160, (32, 64))]:
    bq, bkv = (block, block) if isinstance(block, int) else block
    partial, full = count_blocks(Q, KV, bq, bkv)
    bm = create_block_mask(causal, 2, 3, Q, KV, device="cpu", BLOCK_SIZE=block)
    present = [[p | f for p, f in zip(pr, fr)] for pr, fr in zip(partial, full)]
    total = len(present) * len(present[0])
    out["block_masks"].append({
        "kv_num_blocks": bm.kv_num_blocks.tolist() == [[[sum(r) for r in partial]] * 3] * 2,
        "full_kv_num_blocks": bm.full_kv_num_blocks.tolist() == [[[sum(r) for r in full]] * 3] * 2,
        "to_dense": bm.to_dense().tolist() == [[present] * 3] * 2,
        "sparsity": [bm.sparsity(), 100 * (1 - sum(map(sum, present)) / total)],
        "whole_blocks": Q % bq == 0 and KV % bkv == 0,
        "shape": list(bm.shape) == [2, 3, Q, KV],
        "string": bm[0, 0].to_string(grid_size=-1).splitlines()[1:] == ["".join("█" * 2 if p else "  " for p in row)
                                                                          for row in present],
        "sliced": bm[1, :, 1:].kv_num_blocks.tolist() == [[[sum(r) for r in partial[1:]]] * 3],
        "sliced_shape": list(bm[1, :, 1:].shape) == [1, 3, Q - bq, KV],  # packed rows (torch 2.14+)
        "same_after_to": torch.equal(bm.to("cpu").to_dense(), bm.to_dense()),
    })
if "separate_full_blocks" in inspect.signature(create_block_mask).parameters:  # torch 2.15's, not 2.9's
    bm = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16, separate_full_blocks=False)
    out["not_separate"] = [bm.full_kv_num_blocks, bm.kv_num_blocks.tolist() == [[[1, 2, 3, 4]]]]
out["create_mask"] = [create_mask(and_masks(causal, same_doc), 1, 1, L, L, "cpu").tolist() == DOC[None, None].tolist(),
                      create_mask(or_masks(causal, same_doc), None, None, L, L, "cpu").tolist()
                      == ((i >= j) | (docs[:, None] == docs[None, :]))[None, None].tolist(),
                      create_mask(noop_mask, 1, 1, 3, 3, "cpu").all().item()]
out["all"] = sorted(module.__all__)
out["module_of"] = sorted({getattr(module, n).__module__ for n in module.__all__})
print(json.dumps(out))
"""

# where the served module or torch has torch 2.15's behaviour in the details that changed late (error
# messages and types, a sliced BlockMask's query length, __all__): torch 2.4 with torchpatch, torch 2.14+
NEWEST_DETAILS = torch_matches("<2.5") or torch_matches(">=2.14")
NEWEST_ALL = sorted(["BlockMask", "flex_attention", "AuxOutput", "AuxRequest", "FlexKernelOptions", "create_block_mask",
                     "create_mask", "or_masks", "and_masks", "noop_mask"])
CPU_BACKWARD = ["NotImplementedError", "FlexAttention does not support backward on CPU. Please set the input "
                "requires_grad to False or use another device."]


@pytest.fixture(scope="module")
def result():
    return run_json(SCRIPT, env=clean_env(TORCHPATCH="1"), timeout=600)


@through_patch_range("flex-attention-module")
def test_forward_matches_the_definition(result):
    assert set(result["forward"]) == {"no_mod", "causal", "rel_bias", "soft_cap_causal", "document", "gqa_causal",
                                      "empty_row"}
    for name, case in result["forward"].items():
        assert case["out"] <= 1 and case["lse"] <= 1, (name, case)
        assert case["shape"] == [2, 4, 40, 16] and case["dtypes"] == ["torch.float32", "torch.float32"], (name, case)
    assert result["empty_row"] == {"out_zero": True, "lse": [float("-inf")]}
    assert result["aux"] == [True, True, None]


@through_patch_range("flex-attention-module")
def test_errors_are_torchs(result):
    errors = result["errors"]
    assert errors["max_scores_cpu"][0] == "NotImplementedError"
    assert errors["max_scores_cpu"][1].startswith("Returning max scores is not supported on CPU")
    assert errors["lse_and_aux"] == ["ValueError", "Cannot specify both return_lse and return_aux. return_lse is "
                                     "deprecated, please use return_aux=AuxRequest(lse=True) instead."]
    assert errors["heads"][0] == "ValueError" and "Hq=4 and Hkv=2" in errors["heads"][1]
    assert "created for a smaller length than you're using it for" in errors["mask_too_small"][1]
    if NEWEST_DETAILS:
        assert errors["max_scores_cpu"][1] == "Returning max scores is not supported on CPU."
        assert errors["mask_too_small"][0] == "RuntimeError"


@through_patch_range("flex-attention-module")
def test_gradients_match_the_definition(result):
    for name, grads in result["backward"].items():
        if torch_matches(">=2.5,<2.13"):  # this torch's FlexAttention computes gradients on CPU
            assert len(grads) == 3 and all(ratio <= 1 for ratio in grads), (name, grads)
        else:  # torch 2.13+ (and the served module, as 2.15) raise on CPU
            assert grads == CPU_BACKWARD, (name, grads)
    if torch_matches("<2.5"):
        assert set(result["served_backward"]) == {"gqa_causal_soft_cap", "document_empty_row"}
        for name, grads in result["served_backward"].items():
            assert len(grads) == 3 and all(ratio <= 1 for ratio in grads), (name, grads)


@through_patch_range("flex-attention-module")
def test_block_mask_counts_blocks(result):
    assert len(result["block_masks"]) == 3
    for mask in result["block_masks"]:
        got, want = mask.pop("sparsity")
        if mask.pop("whole_blocks") or NEWEST_DETAILS:  # torch 2.9-2.13 miscount a block cut by the end
            assert got == pytest.approx(want, abs=1e-9), mask
        assert mask.pop("sliced_shape") or not NEWEST_DETAILS, mask
        assert mask == {"kv_num_blocks": True, "full_kv_num_blocks": True, "to_dense": True, "shape": True,
                        "string": True, "sliced": True, "same_after_to": True}, mask
    assert result.get("not_separate", [None, True]) == [None, True]
    assert "not_separate" in result or torch_matches("<2.15")
    assert result["create_mask"] == [True, True, True]


@through_patch_range("flex-attention-module")
def test_module_names(result):
    assert set(NEWEST_ALL) <= set(result["all"])
    assert result["all"] == NEWEST_ALL or not NEWEST_DETAILS  # torch 2.9 has create_nested_block_mask too
    if torch_matches("<2.5"):
        # served: the implementation's own objects, under torch's module name (AuxRequest/AuxOutput from flex-attention-aux)
        assert result["module_of"] == ["torch.nn.attention.flex_attention"]


SDPA_MODEL = """
import json, torch, torch.nn as nn, torch.nn.functional as F, torchpatch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention  # torchtitan 0.1.0
import torch.nn.attention._flex_attention as private  # torch 2.4's prototype: untouched

class Attention(nn.Module):  # imports FlexAttention, runs SDPA (torchtitan's default) or FlexAttention
    def __init__(self, use_flex_attn):
        super().__init__()
        self.qkv, self.use_flex_attn = nn.Linear(8, 24), use_flex_attn
    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        if self.use_flex_attn:
            mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 5, 5, device="cpu")
            return flex_attention(q, k, v, block_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

torch.manual_seed(0)
x = torch.randn(1, 5, 8)
sdpa, flex = Attention(False), Attention(True)
flex.load_state_dict(sdpa.state_dict())
with torch.no_grad():
    want = sdpa(x)
    print(json.dumps({"close": torch.allclose(want, flex(x), atol=1e-6),
                      "compiled_close": torch.allclose(want, torch.compile(flex)(x), atol=1e-6),  # runs the eager computation
                      "private": private._flex_attention.__module__,
                      "status": torchpatch.status().get("flex-attention-module")}))
"""


@where_patch_applies("flex-attention-module")
def test_torchtitan_style_model_runs_either_attention_compiled_or_not():
    out = run_json(SDPA_MODEL, env=clean_env(TORCHPATCH="1"))
    assert out == {"close": True, "compiled_close": True, "private": "torch.nn.attention._flex_attention",
                   "status": "applied"}


INACTIVE = """
import json, torch, torchpatch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention, noop_mask
import torch.nn.attention.flex_attention as module
print(json.dumps({"module_of": [f.__module__ for f in (flex_attention, create_block_mask, BlockMask, noop_mask)],
                  "file": module.__file__.replace("\\\\", "/").endswith("torch/nn/attention/flex_attention.py"),
                  "status": torchpatch.status().get("flex-attention-module")}))
"""


@only_torch(">=2.5", "torch's own flex_attention module")
def test_inactive_where_torch_has_it():
    out = run_json(INACTIVE, env=clean_env(TORCHPATCH="1"))
    assert out == {"module_of": ["torch.nn.attention.flex_attention"] * 4, "file": True, "status": None}


@only_torch("<2.4", "FlexAttention is served from torch 2.4 only")
def test_not_served_before_2_4():
    out = import_with_torchpatch('from torch.nn.attention.flex_attention import flex_attention', 'flex-attention-module')
    assert out == {"error": "ModuleNotFoundError", "status": None}

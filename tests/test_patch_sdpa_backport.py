"""sdpa-backport: ``F.scaled_dot_product_attention`` on torch 1.13 equals torch 2.13's math backend
(written op for op in the test and compared bit for bit in the same process; that transcription is
checked against torch 2.13's own in its session) and the definition computed in float64 in the run,
within a derived tolerance; ``torch.nn.attention.sdpa_kernel``/``SDPBackend`` on torch 1.13-2.2 set
the backend flags the way torch 2.13's do; inactive where torch has them."""

from conftest import clean_env, only_torch, run_json, torch_matches, where_patch_applies, where_patch_does_not_apply
from reference import LOAD, REFERENCE_DIR

SDPA_JSON = str(REFERENCE_DIR / "sdpa.json")

NATIVE = """
import json, torch, torch.nn.functional as F
out = {}
try:
    F.scaled_dot_product_attention
    out["sdpa"] = None
except AttributeError as exc:
    out["sdpa"] = str(exc)
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out["attention"] = None
except ImportError as exc:
    out["attention"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


@only_torch("<2.0", "torch 2.0 brought scaled_dot_product_attention")
def test_native_failures_on_113():
    out = run_json(NATIVE)
    assert out["sdpa"] == "module 'torch.nn.functional' has no attribute 'scaled_dot_product_attention'"
    assert out["attention"] == "ModuleNotFoundError: No module named 'torch.nn.attention'"


@only_torch(">=2.0,<2.3", "torch 2.3 brought torch.nn.attention")
def test_native_failure_on_21():
    out = run_json(NATIVE)
    assert out["sdpa"] is None
    assert out["attention"] == "ModuleNotFoundError: No module named 'torch.nn.attention'"


# The numeric references, computed in each run (nothing recorded on another CPU: a float kernel's last
# bits depend on the CPU's vector width, e.g. AVX-512 vs AVX2 builds of torch 2.13 differ by 1 ulp).
#
# 1. definition(): softmax(q k^T * scale + mask) v from the definition, in float64 with Python's own
#    arithmetic (no torch kernel): each logit exact (Fraction) and rounded once, then per row
#    exp(x - max), math.fsum, and a row masked entirely gives zeros (torch 2.13's math backend, not
#    NaN); is_causal keeps j <= i (top left), a boolean mask True = attend, enable_gqa maps query head
#    h to key/value head h // (Hq / H). With it, a tolerance per output element, derived from the
#    rounding errors of the computation under test (u: unit roundoff of the precision it computes in,
#    float32 for float16/bfloat16/float32, float64 for float64; E the head size, S the key length;
#    a_j = |scale| * sum_e |q_e k_je| + |mask_j|, A = max_j a_j over the row's unmasked keys,
#    B_c = sum_j w_j |v_jc|; bounds to first order in u, for any summation order [Higham, Accuracy
#    and Stability of Numerical Algorithms, 2nd ed., section 3.1: |fl(x.y) - x.y| <= n u |x|.|y|]):
#    - logits: sqrt(scale) rounded and applied to q and to k (4u per product), the E-term dot
#      product (E u), the mask added (u): |dx_j| <= (E + 5) u a_j;
#    - softmax: logit errors move log w_j by dx_j - sum_t w_t dx_t, at most 2 max|dx|; x - max
#      rounds (u |x - max| <= 2u A), exp is within 1 ulp (2u; glibc and Sleef's u10 kernels), the
#      S-term sum of positive terms ((S - 1)u) and the division (u): |dw_j| <= ((2E + 12) A + S + 2) u w_j;
#    - the S-term product with v: S u B_c, plus the weights' errors: |d out_c| <= ((2E + 12) A +
#      2S + 2) u B_c;
#    - float16/bfloat16: the result is cast back (u_cast |out_c|, u_cast that dtype's roundoff).
#    The reference's own error (correctly rounded logits and sums, libm exp) is below the same
#    expression with u = 2^-53, so u is taken as u(compute) + 2^-53; the whole is doubled for the
#    dropped second-order terms. A fully masked row's tolerance is 0: exactly zero is required.
#    Each case reports rel_tol, the largest tolerance relative to B (or |out| for the cast): it must
#    stay below 1% so the check discriminates (wrong scale, mask or causal side move outputs O(1)).
# 2. math_backend(): torch 2.13's math backend written op for op with the installed torch's
#    operators; compared bit for bit in the same process (no CPU dependence). On torch 2.13 it is
#    checked against torch's own math backend; on torch 1.13 the served function must equal it.
DEFINITION = """
import math
from fractions import Fraction

def definition(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    E, L, S, Ev = q.shape[-1], q.shape[-2], k.shape[-2], v.shape[-1]
    hq, hk, hv = (q.shape[-3], k.shape[-3], v.shape[-3]) if q.dim() >= 3 else (1, 1, 1)
    Q = q.double().reshape(-1, hq, L, E).tolist()
    K = k.double().reshape(-1, hk, S, E).tolist()
    V = v.double().reshape(-1, hv, S, Ev).tolist()
    if attn_mask is not None:
        m = torch.broadcast_to(attn_mask, (*q.shape[:-1], S)).reshape(-1, hq, L, S)
        M = m.tolist() if m.dtype == torch.bool else m.double().tolist()
    s = 1 / math.sqrt(E) if scale is None else float(scale)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    u = UNIT_ROUNDOFF[compute] + UNIT_ROUNDOFF[torch.float64]
    u_cast = UNIT_ROUNDOFF[q.dtype] if q.dtype != compute else 0.0
    out, tol, rel_tol = [], [], 0.0
    for b in range(len(Q)):
        for h in range(hq):
            kh, vh = (h // (hq // hk), h // (hq // hv)) if enable_gqa else (h, h)
            for i in range(L):
                logits, sizes = [], []
                for j in range(S):
                    mask = 0.0 if attn_mask is None else M[b][h][i][j]
                    if (is_causal and j > i) or mask is False or mask == -math.inf:
                        logits.append(-math.inf)
                        continue
                    mask = 0.0 if mask is True else mask
                    qk = [(Fraction(a), Fraction(c)) for a, c in zip(Q[b][h][i], K[b][kh][j])]
                    logits.append(float(Fraction(s) * sum(a * c for a, c in qk) + Fraction(mask)))
                    sizes.append(abs(s) * float(sum(abs(a * c) for a, c in qk)) + abs(mask))
                if not sizes:  # every key masked: zeros
                    out.append([0.0] * Ev)
                    tol.append([0.0] * Ev)
                    continue
                top = max(logits)
                e = [math.exp(x - top) for x in logits]
                z = math.fsum(e)
                rel = 2 * ((2 * E + 12) * max(sizes) + 2 * S + 2) * u
                rel_tol = max(rel_tol, rel + 2 * u_cast)
                row = [math.fsum(w * V[b][vh][j][c] for j, w in enumerate(e)) / z for c in range(Ev)]
                size = [math.fsum(w * abs(V[b][vh][j][c]) for j, w in enumerate(e)) / z for c in range(Ev)]
                out.append(row)
                tol.append([rel * bc + 2 * u_cast * abs(oc) for oc, bc in zip(row, size)])
    shape = (*q.shape[:-1], Ev)
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.float64).reshape(shape)
    return as_tensor(out), as_tensor(tol), rel_tol
"""

MATH_BACKEND = """
import math

def math_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # torch 2.13, aten/src/ATen/native/transformers/attention.cpp: convert_boolean_attn_mask, then
    # _scaled_dot_product_attention_math (and pre_process_group_query_attention_input, _safe_softmax).
    origin = query.dtype
    def additive(mask, dtype):
        return torch.where(mask.logical_not(), torch.full((), -math.inf, dtype=dtype), torch.zeros((), dtype=dtype))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = additive(attn_mask, origin)
    if origin in (torch.float16, torch.bfloat16):
        query, key, value = query.float(), key.float(), value.float()
    negative = scale is not None and scale < 0.0
    softmax_scale = (abs(scale) if negative else scale) if scale is not None else 1.0 / math.sqrt(query.size(-1))
    scaling_factor = math.sqrt(softmax_scale)
    query = query * ((0.0 - scaling_factor) if negative else scaling_factor)
    if is_causal:
        attn_mask = additive(torch.ones(query.size(-2), key.size(-2), dtype=torch.bool).tril(), query.dtype)
    if enable_gqa and not (query.size(-3) == key.size(-3) == value.size(-3)):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    attn = torch.matmul(query, key.transpose(-2, -1) * scaling_factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    weights = torch.softmax(attn, -1)
    weights = torch.where(attn.eq(-math.inf).all(-1, keepdim=True), torch.zeros((), dtype=weights.dtype), weights)
    if dropout_p > 0.0:
        weights = torch.dropout(weights, dropout_p, True)
    return torch.matmul(weights, value).to(origin)
"""

# Every case through the public names (served on 1.13, torch's own on 2.13) under
# sdpa_kernel(MATH): the error torch 2.13 raises (recorded: messages are not CPU dependent), or the
# result against definition() and, bit for bit, math_backend() (dropout 0 and 0.3, same seed).
CASES = LOAD + DEFINITION + MATH_BACKEND + """
import sys, torch.nn.functional as F, torchpatch
from torch.nn.attention import SDPBackend, sdpa_kernel
results = {}
for case in load(sys.argv[1]):
    q, k, v, mask = (tensor(case[n]) for n in ("query", "key", "value", "attn_mask"))
    kwargs = case["kwargs"]
    if "error" in case:
        try:
            with sdpa_kernel(SDPBackend.MATH):
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        except RuntimeError as exc:
            message = str(exc).splitlines()[0]
            results[case["name"]] = True if message.startswith(case["error"]) else message
        else:
            results[case["name"]] = "no error"
        continue
    ref, tol, rel_tol = definition(q, k, v, mask, **kwargs)
    verdict = {"rel_tol": rel_tol}
    for p in (0.0, 0.3):
        torch.manual_seed(7)
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **kwargs)
        if p == 0.0:
            verdict["definition"] = within(out, ref, tol) if out.dtype == q.dtype else str(out.dtype)
        torch.manual_seed(7)
        verdict[f"math_backend, dropout {p}"] = same(out, math_backend(q, k, v, mask, dropout_p=p, **kwargs))
    results[case["name"]] = verdict
print(json.dumps({"results": results, "status": torchpatch.status().get("sdpa-backport"),
                  "sdpa": getattr(F.scaled_dot_product_attention, "__module__", None)}))
"""


def _check_cases(results: dict) -> None:
    errors = {name: r for name, r in results.items() if name.startswith("error: ")}
    assert errors == {name: True for name in errors} and len(errors) == 6
    values = {name: r for name, r in results.items() if name not in errors}
    assert len(values) == 16
    expected = {"definition": True, "math_backend, dropout 0.0": True, "math_backend, dropout 0.3": True}
    wrong = {name: r for name, r in values.items() if {key: r[key] for key in expected} != expected}
    assert wrong == {}, wrong
    loose = {name: r["rel_tol"] for name, r in values.items() if not r["rel_tol"] < 0.01}
    assert loose == {}, loose


@only_torch("<2.0")
def test_backport_matches_definition_and_torch_213_math_backend():
    out = run_json(CASES, env=clean_env(TORCHPATCH="1"), args=(SDPA_JSON,))
    assert out["sdpa"] == "torchpatch.patches.attention.sdpa_backport" and out["status"] == "applied"
    _check_cases(out["results"])


@only_torch(">=2.13", "the expectations are torch 2.13's: this checks its own math backend meets them")
def test_torch_213_meets_the_same_expectations():
    out = run_json(CASES, env=clean_env(TORCHPATCH="1"), args=(SDPA_JSON,))
    assert out["status"] is None  # nothing served: torch's own SDPA
    _check_cases(out["results"])


# The backport itself (imported directly) against torch 2.13's math backend in the same process, bit
# for bit, dropout included (same generator, same draws).
DIRECT = LOAD + """
import sys, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchpatch.patches.attention.sdpa_backport import scaled_dot_product_attention as backport
verdicts = {}
for case in load(sys.argv[1]):
    if "error" in case:
        continue
    q, k, v, mask = (tensor(case[n]) for n in ("query", "key", "value", "attn_mask"))
    for p in (0.0, 0.3):
        torch.manual_seed(7)
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, **case["kwargs"])
        torch.manual_seed(7)
        verdicts[f"{case['name']}, dropout {p}"] = same(backport(q, k, v, attn_mask=mask, dropout_p=p, **case["kwargs"]), ref)
print(json.dumps(verdicts))
"""


@only_torch(">=2.13", "the reference: torch 2.13's math backend")
def test_backport_is_bitwise_torch_213_math_backend():
    verdicts = run_json(DIRECT, args=(SDPA_JSON,))
    assert verdicts == {name: True for name in verdicts} and len(verdicts) == 32


# Dropout and gradients: with value = identity, the output *is* the dropped attention weights;
# every kept weight is scaled by 1/(1-p), the dropped ones are those torch.dropout draws from the
# same seed, and the backward pass matches finite differences.
DROPOUT = """
import json, torch, torch.nn.functional as F, torchpatch
from torch.nn.attention import SDPBackend, sdpa_kernel
g = torch.Generator().manual_seed(0)
q, k = torch.randn(4, 8, 16, 8, generator=g), torch.randn(4, 8, 32, 8, generator=g)
eye = torch.eye(32).expand(4, 8, 32, 32)
p = 0.25
with sdpa_kernel(SDPBackend.MATH):
    weights = F.scaled_dot_product_attention(q, k, eye)
    torch.manual_seed(3)
    dropped = F.scaled_dot_product_attention(q, k, eye, dropout_p=p)
    torch.manual_seed(3)
    again = F.scaled_dot_product_attention(q, k, eye, dropout_p=p)
    torch.manual_seed(3)
    draw = torch.dropout(torch.ones_like(weights), p, True) != 0
    x = [torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(3)]
    mask = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    grad_ok = torch.autograd.gradcheck(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=mask, scale=0.7), x)
    grad_causal = torch.autograd.gradcheck(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), x)
kept = dropped != 0
print(json.dumps({
    "rows_sum_to_one": torch.allclose(weights.sum(-1), torch.ones(4, 8, 16)),
    "reproducible": torch.equal(dropped, again),
    "kept_is_torch_dropout_draw": torch.equal(kept, draw),
    "kept_scaled": torch.allclose(dropped[kept], weights[kept] / (1 - p), rtol=1e-6, atol=0),
    "dropped_fraction": 1 - kept.float().mean().item(),
    "gradcheck": [grad_ok, grad_causal],
    "status": torchpatch.status().get("sdpa-backport"),
}))
"""


def _check_dropout(out: dict) -> None:
    assert out["rows_sum_to_one"] and out["reproducible"] and out["kept_is_torch_dropout_draw"] and out["kept_scaled"]
    assert abs(out["dropped_fraction"] - 0.25) < 0.02  # 16384 draws
    assert out["gradcheck"] == [True, True]


@only_torch("<2.0")
def test_dropout_and_gradients_on_113():
    out = run_json(DROPOUT, env=clean_env(TORCHPATCH="1"))
    _check_dropout(out)
    assert out["status"] == "applied"


@only_torch(">=2.13", "the same expectations hold for torch 2.13's own math backend")
def test_dropout_and_gradients_reference():
    _check_dropout(run_json(DROPOUT, env=clean_env(TORCHPATCH="1")))


# sdpa_kernel: inside the block exactly the chosen backends' flags are on; afterwards the previous
# flags are back (also after an exception); a wrong type is torch's AssertionError.
KERNEL = """
import json, sys, torch, torch.nn.functional as F, torchpatch
from torch.nn.attention import SDPBackend, sdpa_kernel
NAMES = {"flash": "FLASH_ATTENTION", "mem_efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
def flags():
    return {n: getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in NAMES if hasattr(torch._C, f"_get_{n}_sdp_enabled")}
out = {"members": {n: int(getattr(SDPBackend, n)) for n in ("ERROR", "MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")}}
torch.backends.cuda.enable_flash_sdp(False)  # a non-default state, to see it restored
before = flags()
checks = []
for chosen in ([SDPBackend.MATH], [SDPBackend.FLASH_ATTENTION], [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
               SDPBackend.EFFICIENT_ATTENTION, [SDPBackend.MATH, SDPBackend.MATH], []):
    listed = chosen if isinstance(chosen, list) else [chosen]
    with sdpa_kernel(chosen) as ctx:
        inside = flags()
    checks.append([ctx == {}, inside == {n: getattr(SDPBackend, NAMES[n]) in listed for n in inside}, flags() == before])
q = torch.randn(1, 2, 3, 4)
try:
    with sdpa_kernel([]):
        F.scaled_dot_product_attention(q, q, q)
except RuntimeError as exc:
    out["none_enabled"] = str(exc)
out["restored_after_error"] = flags() == before
try:
    with sdpa_kernel("math"):
        pass
except AssertionError as exc:
    out["wrong_type"] = str(exc)
try:
    with sdpa_kernel([SDPBackend.MATH], set_priority=True):
        pass
    out["set_priority"] = None
except Exception as exc:
    out["set_priority"] = type(exc).__name__
with sdpa_kernel(SDPBackend.MATH):
    math_only = F.scaled_dot_product_attention(q, q, q)
out.update(checks=checks, same_result=torch.equal(math_only, F.scaled_dot_product_attention(q, q, q)),
           n_flags=len(before), status=torchpatch.status().get("sdpa-backport"),
           module=getattr(sys.modules["torch.nn.attention"], "__torchpatch__", None))
print(json.dumps(out))
"""


def _check_kernel(out: dict) -> None:
    assert out["members"] == {"ERROR": -1, "MATH": 0, "FLASH_ATTENTION": 1, "EFFICIENT_ATTENTION": 2}
    assert out["checks"] == [[True, True, True]] * 6
    assert out["none_enabled"].startswith("No viable backend for scaled_dot_product_attention was found.")
    assert out["restored_after_error"] and out["same_result"]
    assert out["wrong_type"] == "Backend must be an instance of SDPBackend or a list of SDPBackend instances, got str"


@where_patch_applies("sdpa-backport")
def test_sdpa_kernel_served():
    out = run_json(KERNEL, env=clean_env(TORCHPATCH="1"))
    _check_kernel(out)
    assert out["n_flags"] == (2 if torch_matches("<2.0") else 3)  # 1.13: flash and math flags only
    assert out["set_priority"] == "NotImplementedError"
    assert out["module"] == "sdpa-backport" and out["status"] == "applied"


@only_torch(">=2.13", "the same expectations hold for torch 2.13's own sdpa_kernel")
def test_sdpa_kernel_reference():
    out = run_json(KERNEL, env=clean_env(TORCHPATCH="1"))
    _check_kernel(out)
    assert out["set_priority"] is None and out["module"] is None and out["status"] is None


@only_torch(">=2.0,<2.3")
def test_torch_own_sdpa_untouched_on_21():
    out = run_json(
        """
        import json, torch, torch.nn.functional as F, torchpatch
        import torch.nn.attention as attention
        print(json.dumps({"builtin": type(F.scaled_dot_product_attention).__name__,
                          "backend": attention.SDPBackend is torch.backends.cuda.SDPBackend}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"builtin": "builtin_function_or_method", "backend": True}


@where_patch_does_not_apply("sdpa-backport", "torch has SDPA and torch.nn.attention: the patch serves nothing")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torch, torch.nn.functional as F, torchpatch
        import torch.nn.attention as attention
        print(json.dumps({"file": attention.__file__.split("torch/")[-1], "served": getattr(attention, "__torchpatch__", None),
                          "builtin": type(F.scaled_dot_product_attention).__name__,
                          "status": torchpatch.status().get("sdpa-backport")}))
        """,
        # 2.3-2.5: sdpa-enable-gqa and sdpa-kernel-priority wrap the function (their own tests)
        env=clean_env(TORCHPATCH="1", TORCHPATCH_SDPA_ENABLE_GQA="0", TORCHPATCH_SDPA_KERNEL_PRIORITY="0"),
    )
    assert out == {"file": "nn/attention/__init__.py", "served": None, "builtin": "builtin_function_or_method", "status": None}

"""nn-utils-clip-grads: ``get_total_norm`` / ``clip_grads_with_norm_`` before torch 2.6, checked
against their definition computed in float64 in the run (within derived tolerances; torch's own
functions from 2.6 meet the same expectations) and, bit for bit, against the installed torch's own
``clip_grad_norm_`` in the same process; torch's own functions from 2.6."""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies, where_patch_does_not_apply
from reference import LOAD, REFERENCE_DIR

CLIP_JSON = str(REFERENCE_DIR / "clip_grads.json")


@where_patch_applies("nn-utils-clip-grads", "torch 2.6 added the two functions")
def test_native_failure():
    proc = run_py("import torch; torch.nn.utils.get_total_norm([torch.ones(2)])")
    assert "AttributeError: module 'torch.nn.utils' has no attribute 'get_total_norm'" in proc.stderr
    proc = run_py("import torch; from torch.nn.utils import clip_grads_with_norm_")
    assert "ImportError: cannot import name 'clip_grads_with_norm_' from 'torch.nn.utils'" in proc.stderr


# The numeric references, computed in each run (nothing recorded on another CPU: a float kernel's last
# bits depend on the CPU's vector width and hence its summation order):
# 1. the definition in float64 with Python's own arithmetic: the p-norm of each tensor (math.fsum of
#    |g|^p, then the 1/p-th power; inf: the largest |g|), the p-norm of those norms, max_norm =
#    max_norm_ratio * that norm, coefficient min(max_norm / (norm + 1e-6), 1), grads times it. Each
#    case's tolerance bounds the rounding errors of the computation under test (first order in u, for
#    any summation order [Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 3.1]):
#    - total norm: u the unit roundoff of the precision the norms accumulate in (float32 for
#      float32/bfloat16 grads, float64 for float64; a mix: the coarsest), n the largest tensor's
#      numel, m the number of tensors, k = max(1, 1/p). Per tensor: |g|^p within 1 ulp (2u), the
#      n-term sum of positive terms (n - 1)u, the 1/p-th power divides that relative error by p and
#      adds 2u: (n + 3) k u. The norm of the m norms adds (m + 3) k u. A narrower result dtype
#      (bfloat16) rounds each norm and the total once more: 2 u_store. So |dN| <= ((n + m + 6) k u +
#      2 u_store) N. The reference's own error is below that with u = 2^-53: u is taken as
#      u(accumulation) + 2^-53. inf norm: picking the largest |g| is exact, so the tolerance is 0.
#    - clipped grads: the coefficient is computed in the total norm's dtype (u_t: the + 1e-6 and the
#      division) and the product rounds in the grad's dtype (u_g): |dg'| <= (dN/N + 2 u_t + u_g) |g'|.
#      Where the coefficient is clamped to 1 with room to spare, the grads must be untouched, bit for
#      bit (a multiplication by exactly 1).
#    Each bound is doubled for the dropped second-order terms; rel_tol (the largest relative
#    tolerance) must stay below 5% (bfloat16 grads: the coefficient and the product round to 8 bits;
#    float32 cases are near 1e-5), so the check still tells a wrong norm or coefficient.
# 2. the installed torch's own one-step clip_grad_norm_ on a copy of the same grads, bit for bit
#    (same process, same kernels).
REFERENCE = LOAD + """
import functools, inspect, math, sys, torch.nn as nn, torchpatch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

def definition(grads, norm_type):
    p = float(norm_type)
    def norm(xs):
        if p == math.inf:
            return max((abs(x) for x in xs), default=0.0)
        return math.fsum(abs(x) ** p for x in xs) ** (1.0 / p)
    total = norm([norm(g.double().flatten().tolist()) for g in grads])
    if p == math.inf:
        return total, 0.0
    accumulate = max(UNIT_ROUNDOFF[torch.float64 if g.dtype == torch.float64 else torch.float32] for g in grads)
    store = max(UNIT_ROUNDOFF[g.dtype] if g.dtype in (torch.float16, torch.bfloat16) else 0.0 for g in grads)
    n, m = max(g.numel() for g in grads), len(grads)
    return total, 2 * ((n + m + 6) * max(1.0, 1.0 / p) * (accumulate + UNIT_ROUNDOFF[torch.float64]) + 2 * store)

own_has_foreach = "foreach" in inspect.signature(nn.utils.clip_grad_norm_).parameters
verdicts, own, rel_tols = {}, {}, {}
for case in load(sys.argv[1]):
    spec = case["spec"]
    def params():
        out = []
        for g in case["grads"]:
            p = nn.Parameter(torch.zeros(tensor(g).shape if g else [3], dtype=tensor(g).dtype if g else torch.float32))
            p.grad = tensor(g)
            out.append(p)
        return out
    ps = params()
    grads = [p.grad for p in ps if p.grad is not None]
    originals = [None if p.grad is None else p.grad.clone() for p in ps]
    ref_total, rel_total = definition(grads, spec["norm_type"])
    max_norm = spec["max_norm_ratio"] * ref_total
    total = get_total_norm(grads[0] if spec.get("single") else grads, spec["norm_type"], False, spec["foreach"])
    clip_grads_with_norm_(ps[0] if spec.get("single") else ps, max_norm, total, spec["foreach"])
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in grads])
    verdict = [str(total.dtype) if total.dtype != dtype else within(total, torch.tensor(ref_total, dtype=torch.float64),
                                                                     torch.tensor(rel_total * ref_total, dtype=torch.float64))]
    coefficient = max_norm / (ref_total + 1e-6)
    rel_tols[spec["name"]] = [rel_total, 0.0]  # [total norm, clipped grads]
    for p, g in zip(ps, originals):
        if g is None:
            verdict.append(p.grad is None)
            continue
        rel = rel_total + 2 * (2 * UNIT_ROUNDOFF[dtype] + UNIT_ROUNDOFF[g.dtype])
        rel_tols[spec["name"]][1] = max(rel_tols[spec["name"]][1], rel)
        if coefficient * (1 - rel) > 1:  # clamped to 1 whatever the rounding: untouched
            verdict.append(same(p.grad, g))
        else:
            want = g.double() * min(coefficient, 1.0)
            verdict.append(within(p.grad, want, rel * want.abs()))
    verdicts[spec["name"]] = verdict
    qs = params()
    kwargs = {"foreach": spec["foreach"]} if own_has_foreach else {}
    own_total = nn.utils.clip_grad_norm_(qs[0] if spec.get("single") else qs, max_norm, spec["norm_type"], **kwargs)
    own[spec["name"]] = [same(total, own_total.to(total.dtype))] + [
        same(p.grad, q.grad) if q.grad is not None else p.grad is None for p, q in zip(ps, qs)]
print(json.dumps({"verdicts": verdicts, "own": own, "rel_tols": rel_tols,
                  "status": torchpatch.status().get("nn-utils-clip-grads"), "module": get_total_norm.__module__}))
"""


def _reference():
    return run_json(REFERENCE, env=clean_env(TORCHPATCH="1"), args=(CLIP_JSON,))


def _all_true(verdicts: dict) -> dict:
    return {name: v for name, v in verdicts.items() if v != [True] * len(v)}


def _check_definition(out: dict) -> None:
    assert len(out["verdicts"]) == 21
    assert _all_true(out["verdicts"]) == {}  # norms and clipped grads within the derived tolerances
    assert {name: tols for name, tols in out["rel_tols"].items() if not max(tols) < 0.05} == {}
    exact = [name for name, (norm_tol, _) in out["rel_tols"].items() if norm_tol == 0.0]
    assert exact == [f"norm inf, foreach={f}" for f in (None, False, True)]  # inf norms: exact


@where_patch_applies("nn-utils-clip-grads")
def test_served_matches_definition():
    out = _reference()
    assert out["module"] == "torchpatch.patches.nn.nn_utils_clip_grads" and out["status"] == "applied"
    _check_definition(out)


@where_patch_applies("nn-utils-clip-grads", "the second reference: the installed torch's own one-step clip_grad_norm_")
def test_served_matches_installed_clip_grad_norm():
    out = _reference()
    assert _all_true(out["own"]) == {} and len(out["own"]) == 21  # bit for bit


@where_patch_does_not_apply("nn-utils-clip-grads", "torch's own functions: the same expectations hold")
def test_torch_own_functions_meet_the_same_expectations():
    out = _reference()
    assert out["module"] == "torch.nn.utils.clip_grad" and out["status"] is None
    _check_definition(out)
    assert _all_true(out["own"]) == {} and len(out["own"]) == 21


EDGES = """
import json, torch, torchpatch
from torch.nn.utils import clip_grads_with_norm_, get_total_norm
out = {}
out["empty"] = [get_total_norm([]).tolist(), str(get_total_norm([]).dtype)]
w = torch.randn(3, requires_grad=True)
out["no_autograd"] = get_total_norm([w * 2]).requires_grad
out["generator"] = get_total_norm(t for t in [torch.ones(4), torch.ones(5)]).item() == 3.0
bad = [torch.tensor([1.0, float("nan")])]
try:
    get_total_norm(bad, error_if_nonfinite=True)
except RuntimeError as exc:
    out["nonfinite"] = str(exc)
out["nan_allowed"] = get_total_norm(bad).isnan().item()
try:
    get_total_norm([torch.ones(2, device="meta")], foreach=True)
except RuntimeError as exc:
    out["foreach_meta"] = str(exc)
p = torch.nn.Parameter(torch.ones(2))
clip_grads_with_norm_([p], 1.0, torch.tensor(5.0))
out["no_grad_params"] = p.grad is None
p.grad = torch.full((2,), 3.0)
clip_grads_with_norm_(p, 1.0, torch.tensor(float("inf")))
out["inf_norm_zeroes"] = p.grad.tolist()
out["status"] = torchpatch.status().get("nn-utils-clip-grads")
print(json.dumps(out))
"""


def _check_edges(out: dict) -> None:
    assert out["empty"] == [0.0, "torch.float32"] and out["no_autograd"] is False and out["generator"]
    assert out["nonfinite"] == ("The total norm of order 2.0 for gradients from `parameters` is non-finite, so it "
                                "cannot be clipped. To disable this error and scale the gradients by the non-finite "
                                "norm anyway, set `error_if_nonfinite=False`")
    assert out["nan_allowed"] is True
    assert out["foreach_meta"] == "foreach=True was passed, but can't use the foreach API on meta tensors"
    assert out["no_grad_params"] and out["inf_norm_zeroes"] == [0.0, 0.0]


@where_patch_applies("nn-utils-clip-grads")
def test_edges():
    out = run_json(EDGES, env=clean_env(TORCHPATCH="1"))
    _check_edges(out)
    assert out["status"] == "applied"


@only_torch(">=2.13", "the same expectations hold for torch 2.13's own functions")
def test_edges_reference():
    _check_edges(run_json(EDGES, env=clean_env(TORCHPATCH="1")))


@where_patch_does_not_apply("nn-utils-clip-grads", "torch has the functions: nothing is served")
def test_inactive_where_torch_has_them():
    out = run_json(
        """
        import json, torch, torchpatch
        print(json.dumps({"modules": [torch.nn.utils.get_total_norm.__module__, torch.nn.utils.clip_grads_with_norm_.__module__],
                          "status": torchpatch.status().get("nn-utils-clip-grads")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"modules": ["torch.nn.utils.clip_grad"] * 2, "status": None}

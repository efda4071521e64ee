"""sdpa-backport: ``F.scaled_dot_product_attention`` on torch 1.13 equals torch 2.13's math backend
(reference values recorded from torch 2.13, checked against torch 2.13 itself in its own session);
``torch.nn.attention.sdpa_kernel``/``SDPBackend`` on torch 1.13-2.2 set the backend flags the way
torch 2.13's do; inactive where torch has them."""

from conftest import clean_env, only_torch, run_json, torch_matches
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


# Every reference case through the public names (served on 1.13, torch's own on 2.13), under
# sdpa_kernel(MATH): results, or the error torch 2.13 raised.
REFERENCE = LOAD + """
import sys, torch.nn.functional as F, torchpatch
from torch.nn.attention import SDPBackend, sdpa_kernel
verdicts = {}
for case in load(sys.argv[1]):
    q, k, v, mask = (tensor(case[n]) for n in ("query", "key", "value", "attn_mask"))
    try:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **case["kwargs"])
    except RuntimeError as exc:
        message = str(exc).splitlines()[0]
        verdicts[case["name"]] = message.startswith(case["error"]) if "error" in case else message
    else:
        verdicts[case["name"]] = same(out, tensor(case["output"])) if "output" in case else "no error"
print(json.dumps({"verdicts": verdicts, "status": torchpatch.status().get("sdpa-backport"),
                  "sdpa": getattr(F.scaled_dot_product_attention, "__module__", None)}))
"""


@only_torch("<2.0")
def test_backport_matches_torch_213_math_backend():
    out = run_json(REFERENCE, env=clean_env(TORCHPATCH="1"), args=(SDPA_JSON,))
    assert out["sdpa"] == "torchpatch.patches.sdpa_backport" and out["status"] == "applied"
    verdicts = out["verdicts"]
    assert len(verdicts) == 22
    # Bit for bit, errors and fully masked rows included, except where torch 1.13's BLAS rounds a
    # matmul differently in the last bit (measured: the float64 case, 8 values 1 ulp apart).
    loose = {name: v for name, v in verdicts.items() if v is not True}
    assert all(isinstance(v, dict) and v["max_rel"] < 1e-6 for v in loose.values()), loose
    assert len(loose) <= 2, loose


@only_torch(">=2.13", "the reference values are torch 2.13's; this checks they still are")
def test_reference_values_are_torch_213s():
    out = run_json(REFERENCE, env=clean_env(TORCHPATCH="1"), args=(SDPA_JSON,))
    assert out["status"] is None  # nothing served: torch's own SDPA
    assert out["verdicts"] == {name: True for name in out["verdicts"]} and len(out["verdicts"]) == 22


# The backport itself (imported directly) against torch 2.13's math backend, bit for bit,
# dropout included (same generator, same draws).
DIRECT = LOAD + """
import sys, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchpatch.patches.sdpa_backport import scaled_dot_product_attention as backport
verdicts = {}
for case in load(sys.argv[1]):
    if "output" not in case:
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


@only_torch("<2.3")
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


@only_torch(">=2.3", "torch has SDPA and torch.nn.attention: the patch serves nothing")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torch, torch.nn.functional as F, torchpatch
        import torch.nn.attention as attention
        print(json.dumps({"file": attention.__file__.split("torch/")[-1], "served": getattr(attention, "__torchpatch__", None),
                          "builtin": type(F.scaled_dot_product_attention).__name__,
                          "status": torchpatch.status().get("sdpa-backport")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"file": "nn/attention/__init__.py", "served": None, "builtin": "builtin_function_or_method", "status": None}

"""sdpa-kernel-priority: ``sdpa_kernel(backends, set_priority=True)`` on torch 2.4 (torch 2.3-2.5 lack
the keyword). An order torch 2.4 follows (flash, then memory-efficient, then math) enables the same
backends as plain ``sdpa_kernel(backends)``: the same flags inside and after the block and bit-equal
attention outputs and gradients (flash is tried first: the result is flash's, not math's); keyword
and ``set_priority=False`` calls are torch's own; under an order 2.4 cannot follow, attention on CPU
tensors is bit-equal to plain ``sdpa_kernel(backends)`` (as on torch 2.15, which ignores the priority on
CPU), and on another device (``meta``) raises ``NotImplementedError`` naming torch >= 2.6. On torch >= 2.6 the same script runs
torch's own ``sdpa_kernel`` (the reference for the equalities) and the patch stays out of the way."""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

NATIVE = """
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True):
    pass
"""


@where_patch_applies("sdpa-kernel-priority", "torch 2.6 brought set_priority")
def test_native_type_error():
    proc = run_py(NATIVE)
    assert "TypeError: sdpa_kernel() got an unexpected keyword argument 'set_priority'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = """
import inspect, json, torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend as B, sdpa_kernel
from torch.backends.cuda import cudnn_sdp_enabled, flash_sdp_enabled, math_sdp_enabled, mem_efficient_sdp_enabled

def flags():
    return [cudnn_sdp_enabled(), flash_sdp_enabled(), mem_efficient_sdp_enabled(), math_sdp_enabled()]

torch.manual_seed(0)
q, k, v = (torch.randn(2, 3, 33, 16) for _ in range(3))

def attend(ctx):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    with ctx as entered:
        inside = flags()
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
    out.sum().backward()
    return {"inside": inside, "after": flags(), "entered": entered, "out": out.detach(), "grads": [t.grad for t in (qq, kk, vv)]}

def same(a, b):
    return (a["inside"] == b["inside"] and a["after"] == b["after"] and a["entered"] == b["entered"]
            and torch.equal(a["out"], b["out"]) and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"])))

before = flags()
FOLLOWED = {
    "flash,efficient,math": [B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH],
    "flash,math": [B.FLASH_ATTENTION, B.MATH],
    "efficient,math": [B.EFFICIENT_ATTENTION, B.MATH],
    "math": [B.MATH],
    "math (not a list)": B.MATH,
    "flash": [B.FLASH_ATTENTION],
}
out = {"before": before, "followed": {}, "keyword": {}}
for name, backends in FOLLOWED.items():
    plain = attend(sdpa_kernel(backends))
    out["followed"][name] = same(attend(sdpa_kernel(backends, set_priority=True)), plain)
    out["keyword"][name] = same(attend(sdpa_kernel(backends=backends, set_priority=True)), plain)
flash, math = attend(sdpa_kernel([B.FLASH_ATTENTION])), attend(sdpa_kernel([B.MATH]))
first = attend(sdpa_kernel([B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH], set_priority=True))
out["flash_differs_from_math"] = not torch.equal(flash["out"], math["out"])  # so the next check discriminates
out["flash_tried_first"] = torch.equal(first["out"], flash["out"])
unordered = [B.MATH, B.FLASH_ATTENTION]
out["no_priority"] = same(attend(sdpa_kernel(unordered, set_priority=False)), attend(sdpa_kernel(unordered)))
out["unfollowable"] = {}
for name, backends in {"math,flash": unordered,
                       "efficient,flash": [B.EFFICIENT_ATTENTION, B.FLASH_ATTENTION],
                       "flash,math,efficient": [B.FLASH_ATTENTION, B.MATH, B.EFFICIENT_ATTENTION],
                       "cudnn,flash": [B.CUDNN_ATTENTION, B.FLASH_ATTENTION],
                       "cudnn,flash,math (torchtitan 0.2.2)": [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.MATH]}.items():
    cpu = same(attend(sdpa_kernel(backends, set_priority=True)), attend(sdpa_kernel(backends)))
    try:
        with sdpa_kernel(backends, set_priority=True):
            F.scaled_dot_product_attention(*(t.to("meta") for t in (q, k, v)))
        error = None
    except NotImplementedError as exc:
        error = str(exc)
    out["unfollowable"][name] = [cpu, error, flags()]
out["after_all"] = flags()
out["signature_has_set_priority"] = "set_priority" in inspect.signature(sdpa_kernel).parameters
out["wrapper"] = type(sdpa_kernel).__name__
try:
    import torchpatch
    out["status"] = torchpatch.status().get("sdpa-kernel-priority")
except ImportError:
    out["status"] = None
print(json.dumps(out))
"""


def check_equalities(out):
    assert out["followed"] == {name: True for name in out["followed"]}, out["followed"]
    assert out["keyword"] == {name: True for name in out["keyword"]}, out["keyword"]
    assert out["flash_differs_from_math"] is True
    assert out["flash_tried_first"] is True
    assert out["no_priority"] is True
    assert out["after_all"] == out["before"]


@where_patch_applies("sdpa-kernel-priority")
def test_followed_orders_equal_plain_sdpa_kernel():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["status"] == "applied" and out["wrapper"] == "FunctionWrapper"
    check_equalities(out)
    for name, (cpu, error, flags) in out["unfollowable"].items():
        assert cpu is True, name  # on CPU tensors: the backends' own order, as torch 2.15 (which ignores the priority there)
        assert error is not None, name  # another device: refused
        assert error.startswith("sdpa_kernel(") and "on a meta tensor" in error, error
        assert "priority orders need torch >= 2.6" in error, error
        assert flags == out["before"], name  # the block's flags restored after the refusal
    assert "['MATH', 'FLASH_ATTENTION']" in out["unfollowable"]["math,flash"][1]


@only_torch(">=2.6", "the reference: torch's own set_priority")
def test_inactive_and_native_semantics():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["status"] is None and out["wrapper"] == "function" and out["signature_has_set_priority"] is True
    check_equalities(out)
    # torch >= 2.6 honours any order: nothing raises; on CPU tensors it ignores the priority.
    assert {name: error for name, (_, error, _) in out["unfollowable"].items()} == {name: None for name in out["unfollowable"]}
    assert all(cpu for cpu, _, _ in out["unfollowable"].values())

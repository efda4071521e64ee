"""profiler-use-cuda: on torch >= 2.14 both profilers take the removed ``use_cuda`` argument again, with
torch 2.13's meaning. The same assertions hold for torch 2.9-2.13 natively (the behaviour old code was
written against) and for 2.14+ with TORCHPATCH=1; references are the profilers' own current spellings
(``activities=``, ``use_device=``) in the same process."""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

USE = """
import json, warnings, torch
from torch.profiler import ProfilerActivity

def run(make):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with make() as prof:
            torch.ones(8, 8) @ torch.ones(8, 8)
    names = sorted({e.key for e in prof.key_averages()} & {"aten::matmul", "aten::mm", "aten::ones"})
    return {"names": names, "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}

out = {
    "kineto": run(lambda: torch.profiler.profile(use_cuda=False)),
    "kineto_true": run(lambda: torch.profiler.profile(activities=[ProfilerActivity.CPU], use_cuda=True)),
    "kineto_ref": run(lambda: torch.profiler.profile()),
    "autograd": run(lambda: torch.autograd.profiler.profile(use_cuda=True)),
    "autograd_ref": run(lambda: torch.autograd.profiler.profile(use_device="cuda")),
    "autograd_off": run(lambda: torch.autograd.profiler.profile(use_cuda=False)),
}
try:
    torch.profiler.profile(activities=[ProfilerActivity.CUDA], use_cuda=False)
except AssertionError as exc:
    out["empty"] = str(exc)
out["cuda"] = torch.cuda.is_available()
import torchpatch
out["status"] = torchpatch.status().get("profiler-use-cuda")
print(json.dumps(out))
"""

KINETO = "FutureWarning: `use_cuda` is deprecated, use `activities` argument instead"
AUTOGRAD = "FutureWarning: The attribute `use_cuda` will be deprecated soon, please use ``use_device = 'cuda'`` instead."


def assert_torch_213_semantics(out: dict) -> None:
    """What torch 2.13 does with ``use_cuda``, measured against the current spellings."""
    assert out["kineto"]["names"] == out["kineto_ref"]["names"] and "aten::mm" in out["kineto"]["names"]
    assert out["kineto"]["warnings"] == [KINETO] + out["kineto_ref"]["warnings"]
    assert out["kineto_true"]["warnings"][:1] == [KINETO] and out["kineto_true"]["names"] == out["kineto"]["names"]
    assert out["empty"] == "No valid profiler activities found"
    assert out["autograd"]["names"] == out["autograd_ref"]["names"] and "aten::mm" in out["autograd"]["names"]
    assert out["autograd"]["warnings"] == [AUTOGRAD] + out["autograd_ref"]["warnings"]
    if not out["cuda"]:  # torch turns CUDA profiling off, with its own warning, as it does for use_device
        assert any("CUDA is not available" in w for w in out["autograd_ref"]["warnings"])
    assert out["autograd_off"]["warnings"] == [] and out["autograd_off"]["names"] == out["autograd"]["names"]


@where_patch_applies("profiler-use-cuda", "torch 2.14 removed use_cuda")
def test_native_failure():
    for call in ("torch.profiler.profile(use_cuda=True)", "torch.autograd.profiler.profile(use_cuda=True)"):
        proc = run_py(f"import torch; {call}", env=clean_env())
        assert "TypeError" in proc.stderr and "unexpected keyword argument 'use_cuda'" in proc.stderr, proc.stderr


@where_patch_applies("profiler-use-cuda")
def test_served_with_torch_213_semantics():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out["status"] == "applied"
    assert_torch_213_semantics(out)


@where_patch_applies("profiler-use-cuda")
def test_opt_out():
    proc = run_py("import torch; torch.profiler.profile(use_cuda=False)",
                  env=clean_env(TORCHPATCH="1", TORCHPATCH_PROFILER_USE_CUDA="0"))
    assert "unexpected keyword argument 'use_cuda'" in proc.stderr


@only_torch(">=2.9,<2.14", "torch's own use_cuda, the behaviour old code was written against")
def test_native_semantics_and_inactive():
    native = run_json(USE, env=clean_env())
    assert_torch_213_semantics(native)
    patched = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert patched["status"] is None  # out of its torch range: not even armed
    assert {k: v for k, v in patched.items() if k != "status"} == {k: v for k, v in native.items() if k != "status"}

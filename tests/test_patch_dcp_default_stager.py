"""dcp-default-stager: ``staging.DefaultStager`` and ``StagingOptions`` on torch 2.4-2.8.

One script stages a state dict synchronously and asynchronously and checks that the staged copy is
bitwise equal, on the CPU, in new storage (an in-place update after staging does not reach it), in
shared memory when asked; and that the default options (a non-blocking copy) need an accelerator.
It runs served (TORCHPATCH=1) where the patch applies and natively on torch >= 2.9.
"""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

USE = """
import json, warnings, torch, torchpatch
from concurrent.futures import Future
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
warnings.simplefilter("ignore")
torch.manual_seed(0)
state = {"w": torch.randn(3, 4), "opt": {"m": [torch.randn(2), torch.arange(3)]}, "lr": 0.1}
snapshot = {"w": state["w"].clone(), "m0": state["opt"]["m"][0].clone()}
out = {"defaults": [StagingOptions().use_pinned_memory, StagingOptions().use_shared_memory,
                    StagingOptions().use_async_staging, StagingOptions().use_non_blocking_copy]}
sync = DefaultStager(StagingOptions(False, True, False, False))
staged = sync.stage(state)
asyn = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                    use_non_blocking_copy=False))
future = asyn.stage(state)
asyn.synchronize_staging()
staged_async = future.result()
with torch.no_grad():
    state["w"].add_(1.0)
    state["opt"]["m"][0].add_(1.0)
for stager in (sync, asyn):
    stager.close()
def same(s):
    return (torch.equal(s["w"], snapshot["w"]) and torch.equal(s["opt"]["m"][0], snapshot["m0"])
            and torch.equal(s["opt"]["m"][1], torch.arange(3)) and s["lr"] == 0.1 and s["w"].device.type == "cpu")
out.update(sync=same(staged), shared=staged["w"].is_shared(), future=isinstance(future, Future), asyn=same(staged_async),
           protocol=isinstance(sync, AsyncStager))
try:
    DefaultStager()
    out["default"] = "ok"
except AssertionError as exc:
    out["default"] = str(exc)
out["accelerator"] = torch.cuda.is_available()
out["status"] = torchpatch.status().get("dcp-default-stager")
print(json.dumps(out))
"""


def _check(out: dict) -> None:
    assert out["defaults"] == [True, True, True, True]
    assert out["sync"] and out["shared"] and out["future"] and out["asyn"] and out["protocol"]
    if not out["accelerator"]:
        assert out["default"] == "Non-blocking copy requires that the current accelerator is available."


@where_patch_applies("dcp-default-stager", "torch 2.9 added DefaultStager")
def test_native_failure():
    proc = run_py("from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions")
    assert "ImportError: cannot import name 'DefaultStager'" in proc.stderr


@where_patch_applies("dcp-default-stager")
def test_served(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    _check(out)
    assert out["status"] == "applied"


@only_torch(">=2.9", "torch's own DefaultStager: the same results, nothing served")
def test_native(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    _check(out)
    assert out["status"] is None

"""oom-error-alias: ``torch.OutOfMemoryError`` is ``torch.cuda.OutOfMemoryError`` on torch 1.13 and
2.1, so ``except torch.OutOfMemoryError`` catches the CUDA error and lets others through; torch's
own name from 2.4."""

from conftest import clean_env, run_json, where_patch_applies, where_patch_does_not_apply

USE = """
import json, torch, torchpatch

def handle(exc):
    try:
        try:
            raise exc
        except torch.OutOfMemoryError:
            return "caught"
    except Exception as other:
        return f"{type(other).__name__}: {other}"

out = {"oom": handle(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")),
       "other": handle(ValueError("bad batch"))}
out["same"] = getattr(torch, "OutOfMemoryError", None) is torch.cuda.OutOfMemoryError
out["runtime_error"] = issubclass(torch.cuda.OutOfMemoryError, RuntimeError)
out["status"] = torchpatch.status().get("oom-error-alias")
torchpatch.uninstall()
out["after_uninstall"] = "OutOfMemoryError" in vars(torch)
print(json.dumps(out))
"""


@where_patch_applies("oom-error-alias", "torch 2.4 exports torch.OutOfMemoryError")
def test_native_failure():
    out = run_json(USE)
    # The except clause itself fails: the ValueError being handled turns into an AttributeError.
    assert out["oom"] == out["other"] == "AttributeError: module 'torch' has no attribute 'OutOfMemoryError'"


@where_patch_applies("oom-error-alias")
def test_served_as_the_cuda_class():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out == {"oom": "caught", "other": "ValueError: bad batch", "same": True, "runtime_error": True,
                   "status": "applied", "after_uninstall": False}


@where_patch_does_not_apply("oom-error-alias", "torch's own torch.OutOfMemoryError: the same behaviour, nothing served")
def test_inactive_where_torch_has_it():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out == {"oom": "caught", "other": "ValueError: bad batch", "same": True, "runtime_error": True,
                   "status": None, "after_uninstall": True}

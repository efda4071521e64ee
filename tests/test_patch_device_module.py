"""device-module: ``torch._utils._get_device_module`` on torch 1.13, with torch 2.x's results and
error (the same script runs on torch >= 2.1 against torch's own function)."""

from conftest import clean_env, run_json, run_py, where_patch_applies, where_patch_does_not_apply

USE = """
import json, torch, torchpatch
from torch._utils import _get_available_device_type, _get_device_module
device_type = _get_available_device_type() or "cuda"  # torchtitan's way
out = {"cuda": _get_device_module(device_type) is torch.cuda, "cpu": _get_device_module("cpu") is torch.cpu}
try:
    _get_device_module("nosuchdevice")
except RuntimeError as exc:
    out["error"] = str(exc)
out["status"] = torchpatch.status().get("device-module")
print(json.dumps(out))
"""

ERROR = "Device 'nosuchdevice' does not have a corresponding module registered as 'torch.nosuchdevice'."


@where_patch_applies("device-module", "torch 2.1 has it")
def test_native_failure():
    proc = run_py("from torch._utils import _get_device_module")
    assert "ImportError: cannot import name '_get_device_module' from 'torch._utils'" in proc.stderr


@where_patch_applies("device-module")
def test_served():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out == {"cuda": True, "cpu": True, "error": ERROR, "status": "applied"}


@where_patch_does_not_apply("device-module", "torch's own function: the same results, nothing served")
def test_inactive_where_torch_has_it():
    out = run_json(USE, env=clean_env(TORCHPATCH="1"))
    assert out == {"cuda": True, "cpu": True, "error": ERROR, "status": None}

"""flash-attention-registry: torch.nn.attention's flash attention implementation registry on torch
2.4-2.10, as torch 2.15's.

The same script runs served (2.4, 2.9) and natively (2.13+): FA3 and FA4 are registered; activating
them on this machine, which lacks their kernel packages, raises torch 2.15's ``ModuleNotFoundError``;
an unknown name raises its ``ValueError``; a registered implementation's handle becomes the active
one, is removed when another is activated or on restore, and an implementation that returns no
handle leaves nothing active; restoring with nothing active logs torch's warning on the
``torch.nn.attention._registry`` logger. With a fake ``flash_attn_interface`` that registers FA3's
ops, torch 2.11+ goes on to install the kernels, which older torch cannot: there the served
registry raises a ``RuntimeError`` naming the missing SDPA switch.
"""

import logging
import types

import pytest

from conftest import clean_env, only_torch, run_json, run_py, torch_matches

# torch 2.10's registry (FA4 only, activation without restoring first) is not 2.15's: on 2.10 only
# restore_flash_attention_impl is served, on torch's own registry.
REGISTRY_AS_2_15 = pytest.mark.skipif(not torch_matches(">=2.4") or torch_matches(">=2.10,<2.11"),
                                      reason="a registry as torch 2.15's: served on 2.4-2.9, native from 2.11")
SCRIPT = """
import json, logging, torch
from torch.nn.attention import (activate_flash_attention_impl, current_flash_attention_impl,
                                list_flash_attention_impls, register_flash_attention_impl,
                                restore_flash_attention_impl)

records = []
class Collect(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, record.getMessage()])
logging.getLogger("torch.nn.attention._registry").addHandler(Collect())

def error(fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]

events = []
class Handle:
    def __init__(self, name):
        self.name = name
    def remove(self):
        events.append("remove " + self.name)

def register(name, with_handle=True):
    def register_fn():
        events.append("register " + name)
        return Handle(name) if with_handle else None
    register_flash_attention_impl(name, register_fn=register_fn)

out = {"builtin": list_flash_attention_impls(), "current": current_flash_attention_impl(),
       "module": activate_flash_attention_impl.__module__,
       "fa3": error(activate_flash_attention_impl, "FA3"), "fa4": error(activate_flash_attention_impl, "FA4"),
       "unknown": error(activate_flash_attention_impl, "NOPE")}
register("TEST_B"); register("TEST_A"); register("TEST_NONE", with_handle=False)
out["listed"] = list_flash_attention_impls()
activate_flash_attention_impl("TEST_A")
out["after_a"] = current_flash_attention_impl()
activate_flash_attention_impl("TEST_B")
out["after_b"] = current_flash_attention_impl()
restore_flash_attention_impl()
out["after_restore"] = current_flash_attention_impl()
activate_flash_attention_impl("TEST_NONE")
out["after_none"] = current_flash_attention_impl()
restore_flash_attention_impl()
out["events"], out["log"] = events, records
print(json.dumps(out))
"""

FAKE_FA3 = """
import json, sys, types, torch
lib = torch.library.Library("flash_attn_3", "DEF")
lib.define("fwd(Tensor x) -> Tensor")
lib.define("bwd(Tensor x) -> Tensor")
sys.modules["flash_attn_interface"] = types.ModuleType("flash_attn_interface")
from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl
try:
    activate_flash_attention_impl("FA3")
    result = None
except Exception as exc:
    result = [type(exc).__name__, str(exc)]
print(json.dumps({"error": result, "current": current_flash_attention_impl()}))
"""



@only_torch(">=2.4,<2.10", "no registry: all five names served")
def test_native_import_error():
    proc = run_py("from torch.nn.attention import activate_flash_attention_impl")
    assert "ImportError: cannot import name 'activate_flash_attention_impl'" in proc.stderr, proc.stderr[-2000:]


@REGISTRY_AS_2_15
def test_registry_as_torch_2_15():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["builtin"] == ["FA3", "FA4"] and out["current"] is None
    assert out["module"] == "torch.nn.attention"
    assert out["fa3"] == ["ModuleNotFoundError", "No module named 'flash_attn_interface'"]
    assert out["fa4"] == ["ModuleNotFoundError", "No module named 'flash_attn'"]
    assert out["unknown"] == ["ValueError",
                              "Unknown flash attention impl 'NOPE'. Available implementations: ['FA3', 'FA4']"]
    assert out["listed"] == ["FA3", "FA4", "TEST_A", "TEST_B", "TEST_NONE"]
    assert [out[k] for k in ("after_a", "after_b", "after_restore", "after_none")] == ["TEST_A", "TEST_B", None, None]
    assert out["events"] == ["register TEST_A", "remove TEST_A", "register TEST_B", "remove TEST_B",
                             "register TEST_NONE"]
    assert out["log"] == [["torch.nn.attention._registry", "WARNING",
                           "Trying to restore default FA2 impl when no custom impl was activated"]]


@REGISTRY_AS_2_15
def test_fa3_kernels_present():
    out = run_json(FAKE_FA3, env=clean_env(TORCHPATCH="1"))
    if torch_matches(">=2.11"):  # torch installs FA3's kernels in the dispatcher
        assert out == {"error": None, "current": "FA3"}
    else:
        assert out["current"] is None and out["error"][0] == "RuntimeError", out
        assert "FA3 cannot be activated on torch" in out["error"][1]
        assert "torch._C._set_sdp_use_fa3" in out["error"][1]


def test_restore_on_torch_2_10_registry(caplog):
    """torch 2.10's registry keeps the active name and a handle per name (its source); restore, served
    there, removes the active handle and clears the name, or logs torch's warning."""
    from torchpatch.patches.attention.flash_attention_registry import _restore_on_torch_registry

    removed = []
    handle = types.SimpleNamespace(remove=lambda: removed.append("FA4"))
    registry = types.SimpleNamespace(_FLASH_ATTENTION_ACTIVE="FA4", _FLASH_ATTENTION_HANDLES={"FA4": handle})
    restore = _restore_on_torch_registry(registry)
    with caplog.at_level(logging.WARNING, logger="torch.nn.attention._registry"):
        restore()
        assert (removed, registry._FLASH_ATTENTION_ACTIVE, registry._FLASH_ATTENTION_HANDLES) == (["FA4"], None, {})
        assert caplog.records == []
        restore()
        restore(_raise_warn=False)
    assert [r.getMessage() for r in caplog.records] == [
        "Trying to restore default FA2 impl when no custom impl was activated"]

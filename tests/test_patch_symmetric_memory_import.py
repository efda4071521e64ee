"""symmetric-memory-import: ``import torch.distributed._symmetric_memory`` on torch 2.4, every use refused.

Natively 2.4 has no such module (``ModuleNotFoundError``). With the patch the module imports (as torchtitan
0.3.0's MoE code does at module level) with torch 2.15's public names (those of its venv's module, read in
the same test), and calling any of them raises ``NotImplementedError`` naming symmetric memory's C++ piece.
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, where_patch_applies

SCRIPT = '''
import json, torch
import torch.distributed._symmetric_memory as symm_mem
out = {}
for name in symm_mem.__all__ + ["enable_symm_mem_for_group", "is_symm_mem_enabled_for_group"]:
    try:
        getattr(symm_mem, name)(torch.empty(1))
        out[name] = "returned"
    except NotImplementedError as exc:
        out[name] = "C++ SymmetricMemory" in str(exc) and "torch >= 2.5" in str(exc)
print(json.dumps({"all": sorted(symm_mem.__all__), "calls": out}))
'''


@where_patch_applies("symmetric-memory-import", "torch 2.5 added symmetric memory")
def test_native_module_not_found():
    proc = run_py("import torch.distributed._symmetric_memory")
    assert "No module named 'torch.distributed._symmetric_memory'" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("symmetric-memory-import")
def test_imports_with_the_newest_names_and_refuses_every_call():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    newest = run_newest_torch_json("import json, torch.distributed._symmetric_memory as m; print(json.dumps(sorted(m.__all__)))")
    assert out["all"] == newest
    assert set(out["calls"].values()) == {True}, out["calls"]

"""symmetric-memory-import: ``import torch.distributed._symmetric_memory`` on torch 2.4, every use refused.

Natively 2.4 has no such module (``ModuleNotFoundError``). With the patch the module imports (as torchtitan
0.3.0's MoE code does at module level) with torch 2.15's public names (those of its venv's module, read in
the same test): its availability probes (``is_nvshmem_available``, ``is_symm_mem_enabled_for_group``,
``is_symm_mem_tensor``) answer False, as 2.15 does where the piece is missing, and calling any other function
raises ``NotImplementedError`` naming symmetric memory's C++ piece.
"""

from conftest import clean_env, run_json, run_newest_torch_json, run_py, where_patch_applies

SCRIPT = '''
import json, torch
import torch.distributed._symmetric_memory as symm_mem
out = {}
for name in symm_mem.__all__ + ["enable_symm_mem_for_group", "is_symm_mem_enabled_for_group"]:
    try:
        args = () if name == "is_nvshmem_available" else ("0",) if name.endswith("_for_group") else (torch.empty(1),)
        out[name] = getattr(symm_mem, name)(*args)
    except NotImplementedError as exc:
        out[name] = "C++ SymmetricMemory" in str(exc) and "torch >= 2.5" in str(exc)
print(json.dumps({"all": sorted(symm_mem.__all__), "calls": out}))
'''


@where_patch_applies("symmetric-memory-import", "torch 2.5 added symmetric memory")
def test_native_module_not_found():
    proc = run_py("import torch.distributed._symmetric_memory")
    assert "No module named 'torch.distributed._symmetric_memory'" in proc.stderr, proc.stderr[-2000:]


@where_patch_applies("symmetric-memory-import")
def test_imports_with_the_newest_names_answers_absent_and_refuses_every_other_call():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    newest = run_newest_torch_json("import json, torch.distributed._symmetric_memory as m; print(json.dumps(sorted(m.__all__)))")
    assert out["all"] == newest
    probes = {"is_nvshmem_available", "is_symm_mem_enabled_for_group", "is_symm_mem_tensor"}
    assert {name: out["calls"][name] for name in probes} == dict.fromkeys(probes, False)
    assert {name: refused for name, refused in out["calls"].items() if name not in probes} == dict.fromkeys(
        set(out["calls"]) - probes, True), out["calls"]

"""attention-experimental: ``torch.nn.attention.experimental`` on torch 2.4-2.5, as torch 2.15's:
an importable package with no public name. Natively from 2.6 the same script gives the same."""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch.nn.attention.experimental as experimental, torchpatch
public = sorted(n for n in vars(experimental) if not n.startswith("_"))
print(json.dumps({"public": public, "all": getattr(experimental, "__all__", None),
                  "status": torchpatch.status().get("attention-experimental")}))
"""


@where_patch_applies("attention-experimental")
def test_native_module_not_found():
    proc = run_py("import torch.nn.attention.experimental")
    assert "No module named 'torch.nn.attention.experimental'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("attention-experimental")
def test_importable_without_public_names():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["public"] == [] and out["all"] is None

"""The relocation table: derived from the matrix inventories, and each entry that applies to the
installed torch resolves to a module defining the same qualified names."""

import json
import subprocess
import sys

from conftest import REPO, TORCH, clean_env, run_json, torch_matches, torchpatch_command
from torchpatch._registry import builtin_patches

TABLE = json.loads((REPO / "src" / "torchpatch" / "patches" / "_data" / "relocations.json").read_text())
HERE = [e for e in TABLE if torch_matches(e["torch"])]

PROBE = """
import importlib, json, sys, warnings
import torch
warnings.simplefilter("ignore")
out = {}
for name, target, qualnames in json.loads(sys.argv[1]):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        out[name] = "ImportError: " + str(exc)
        continue
    same = module is importlib.import_module(target)
    found = []
    for q in qualnames:
        obj = module
        for part in q.split("."):
            obj = getattr(obj, part, None)
        found.append(getattr(obj, "__qualname__", None) == q)
    out[name] = {"same_module": same, "qualnames_ok": all(found), "n": len(found)}
print(json.dumps(out))
"""


def probe(entries, **env):
    args = json.dumps([[e["name"], e["target"], e["qualnames"]] for e in entries])
    return run_json(PROBE, args=[args], env=clean_env(**env), timeout=300)


def test_table_is_derived_from_the_inventories():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "relocations.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert len(TABLE) > 20 and any(e["alias"] for e in TABLE) and any(not e["alias"] for e in TABLE)
    for e in TABLE:
        assert e["alias"] or e["why_not"].startswith(("signatures changed", "its package"))


def test_entries_for_this_torch_resolve_to_the_same_qualified_names():
    served = [e for e in HERE if e["alias"]]
    refused = [e for e in HERE if not e["alias"]]
    if not HERE:
        assert torch_matches("<2.1"), f"no relocation entry applies to torch {TORCH}"
        return
    native = probe(served + refused)
    assert all(str(v).startswith("ImportError") for v in native.values()), native  # missing natively
    patched = probe(served + refused, TORCHPATCH="1")
    for e in served:
        assert patched[e["name"]] == {"same_module": True, "qualnames_ok": True, "n": len(e["qualnames"])}, e["name"]
    # Signature changed: the relocations patch does not serve the alias. Another patch, having weighed
    # the difference, may serve that name (it wins): a module of its own (dtensor-random:
    # torch.distributed.tensor._random with 2.13's manual_seed only), or the alias itself
    # (dtensor-public: torch.distributed.device_mesh on 2.1, where only a private flag differs).
    others = [p for p in builtin_patches() if p.id != "relocations"]
    own_modules = {name for p in others for name in p.modules}
    other_aliases = {(name, target) for p in others for name, target, _torch in p.aliases}
    for e in refused:
        got = patched[e["name"]]
        if (e["name"], e["target"]) in other_aliases:
            assert got == {"same_module": True, "qualnames_ok": True, "n": len(e["qualnames"])}, e["name"]
        else:
            assert str(got).startswith("ImportError") or (e["name"] in own_modules and not got["same_module"]), e["name"]


def test_relocation_patch_is_inactive_before_2_1():
    rows = {r["id"]: r for r in json.loads(torchpatch_command("list", "--json").stdout)}
    assert rows["relocations"]["applies"] is torch_matches(">=2.1")

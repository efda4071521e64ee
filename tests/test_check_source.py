"""``torchpatch check``'s helper reads torch's sources where they say enough (``_check/source.py``),
instead of importing each module: every answer it gives there must be what importing finds."""

import json

from conftest import clean_env, run_json

# For each module of these packages of the installed torch: every name its source answers for
# (plain top-level bindings, imports, submodule files), compared with the imported module.
PROBE = """
import importlib, json, os, pkgutil, sys, types
import torch
from torchpatch._check.source import bindings, module_file, static_child

root = os.path.dirname(torch.__file__)
missing = object()
out = {"checked": 0, "attr": 0, "module": 0, "wrong": []}
for package in sys.argv[1:]:
    try:
        pkg = importlib.import_module(package)
    except Exception:
        continue
    names = [package] + sorted(m.name for m in pkgutil.walk_packages(getattr(pkg, "__path__", []), package + ".",
                                                                         onerror=lambda n: None))
    for name in names:
        found = module_file(root, name)
        binds = found and bindings(found[0], name, found[1])
        if not binds:
            continue
        candidates = set(binds.plain) | set(binds.imports)
        if found[1]:
            directory = os.path.dirname(found[0])
            candidates |= {f[:-3] if f.endswith(".py") else f for f in os.listdir(directory) if not f.startswith("__")}
        answers = {n: static_child(root, name, n) for n in sorted(candidates)}
        try:
            module = importlib.import_module(name)
        except BaseException:
            continue  # fails to import here: the helper counts it as present, as the inventories do
        for n, answer in answers.items():
            if answer is None:
                continue
            value = getattr(module, n, missing)
            if answer["kind"] == "module" and value is missing:
                try:
                    value = importlib.import_module(answer["name"])
                except BaseException:
                    continue  # a submodule that fails to import here
            out["checked"] += 1
            out[answer["kind"]] += 1
            is_module = isinstance(value, types.ModuleType)
            right = value is not missing and is_module == (answer["kind"] == "module") and (
                not is_module or value.__name__ == answer["name"])
            if not right:
                out["wrong"].append([name, n, answer, repr(value)[:100]])
print(json.dumps(out))
"""


def test_what_the_sources_say_is_what_importing_finds():
    packages = ["torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed.fsdp",
                "torch.distributed.checkpoint", "torch.distributed.pipelining", "torch.nn", "torch.optim",
                "torch.utils.checkpoint", "torch._functorch", "torch.testing"]
    out = run_json(PROBE, args=packages, env=clean_env(), timeout=600)
    assert out["wrong"] == [], json.dumps(out["wrong"], indent=1)
    assert out["attr"] > 500 and out["module"] > 20, out  # the sources answer for much of torch

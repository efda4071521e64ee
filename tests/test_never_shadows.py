"""The shim finder never shadows anything: every torch.distributed module (and torch._six) that
imports natively loads from the very same file with TORCHPATCH=1."""

import json

from conftest import clean_env, run_py

SURVEY = """
import importlib, json, pkgutil, sys, warnings
import torch, torch.distributed
warnings.simplefilter("ignore")
names = {"torch._six"}
def note(name):
    pass
for info in pkgutil.walk_packages(torch.distributed.__path__, "torch.distributed.", onerror=note):
    names.add(info.name)
files = {}
for name in sorted(names):
    try:
        module = importlib.import_module(name)
    except BaseException:
        continue
    files[name] = [getattr(module, "__file__", None), getattr(module, "__torchpatch__", None)]
print(json.dumps(files))
"""


def survey(**env):
    proc = run_py(SURVEY, env=clean_env(**env), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_native_modules_load_from_the_same_file():
    native = survey()
    patched = survey(TORCHPATCH="1")
    assert len(native) > 20
    changed = {n: (native[n], patched.get(n)) for n in native if patched.get(n) != native[n]}
    assert changed == {}
    served = sorted(n for n, (_file, by) in patched.items() if by)
    assert all(n not in native for n in served)

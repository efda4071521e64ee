"""The engine on the installed torch: ``uninstall()`` leaves nothing behind (checked without naming
attributes), a reload applies patches again, and a job prints one summary line.

Every module the armed catalogue acts on that exists natively is imported first; then every
``torch*`` module's namespace (names and object identity), its ``__loader__``/``__spec__`` and
``sys.modules`` are snapshotted; ``install()``; everything the catalogue serves here is used (each
shim module and alias imported, each symbol read, each hooked module imported, plus the names the
engine issue named: ``torch._six``, ``torch.Any``, the alias child
``torch.distributed._tensor._dispatch``); ``uninstall()``. Afterwards only real submodules imported
on the way may be new; every object the snapshot saw is still there."""

import json

import pytest

from conftest import clean_env, only_torch, run_json, run_py, run_ranks

pytestmark = pytest.mark.fresh_interpreter  # the summary line at exit, uninstall and reload of torch modules from a clean start

SCRIPT = r"""
import importlib, json, sys, types
import torch, torchpatch

plans = [p.patch for p in torchpatch.plan(only_applicable=True) if p.active]
served = {name for p in plans for name in p.modules} | {name for p in plans for name, _t, _v in p.aliases}
symbols = {(m, n) for p in plans for m, n in p.symbols} | {("torch", "Any")}
hooked = {m for p in plans for m, _h in p.import_hooks + p.import_time_hooks} | {m for m, _n in symbols}
targets = {t for p in plans for _n, t, _v in p.aliases}
served |= {"torch._six", "torch.distributed._tensor._dispatch"}

def try_import(name):
    try:
        return importlib.import_module(name)
    except Exception as exc:
        return None

for name in sorted(hooked | targets):
    try_import(name)  # natively, before the snapshot

def snapshot():
    out = {}
    for name, m in list(sys.modules.items()):
        if name.split(".")[0] != "torch" or not isinstance(m, types.ModuleType):
            continue
        spec = vars(m).get("__spec__")
        out[name] = (id(m), {k: id(v) for k, v in list(vars(m).items())},
                     id(vars(m).get("__loader__")), id(spec), id(getattr(spec, "loader", None)))
    return out

before = snapshot()
torchpatch.install()
used = {"modules": {}, "symbols": {}}
for name in sorted(served):
    used["modules"][name] = try_import(name) is not None
for module, name in sorted(symbols):
    m = try_import(module)
    used["symbols"][module + "." + name] = m is not None and hasattr(m, name)
for name in sorted(hooked):
    try_import(name)
status = torchpatch.status()
torchpatch.uninstall()
after = snapshot()

def real(name):
    # Imported by torch's own machinery: no shim, torch's loader. A served name (an alias is a real
    # module under another name) must be its own module: torch's BC packages that replace
    # themselves in sys.modules (1.13's torch.distributed._sharded_tensor) are never served names.
    m = sys.modules.get(name)
    spec = getattr(m, "__spec__", None)
    return (isinstance(m, types.ModuleType) and spec is not None and not hasattr(m, "__torchpatch__")
            and "torchpatch" not in type(spec.loader).__module__ and (spec.name == name or name not in served))

problems = []
for name, (mid, ns, loader, spec, spec_loader) in before.items():
    if name not in after or after[name][0] != mid:
        problems.append(f"{name}: module replaced or gone")
        continue
    _mid, ns2, loader2, spec2, spec_loader2 = after[name]
    if (loader, spec, spec_loader) != (loader2, spec2, spec_loader2):
        problems.append(f"{name}: __loader__/__spec__ changed")
    problems += [f"{name}.{k}: changed or gone" for k, v in ns.items() if ns2.get(k) != v]
    for k in set(ns2) - set(ns):
        value = vars(sys.modules[name]).get(k)
        if not (isinstance(value, types.ModuleType) and real(f"{name}.{k}") and sys.modules[f"{name}.{k}"] is value):
            problems.append(f"{name}.{k}: new, and not a real submodule")
for name in set(after) - set(before):
    if not real(name):
        problems.append(f"sys.modules[{name!r}]: new, and not a real module")
for name in served:
    if name in sys.modules and name not in before and not real(name):
        problems.append(f"{name}: still served")
print(json.dumps({"problems": problems, "used": used, "status": status,
                  "served_count": sum(used["modules"].values()) + sum(used["symbols"].values())}))
"""


def test_uninstall_leaves_every_torch_module_as_it_was():
    proc = run_py(SCRIPT, env=clean_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["served_count"] > 0, out  # something was served here, so the check means something
    assert "failed" not in out["status"].values(), out["status"]
    assert out["problems"] == [], out["problems"]


@only_torch(">=2.4", "xla-parallelize wraps parallelize_module from torch 2.4 on")
def test_reload_of_a_patched_torch_module_applies_again_and_uninstall_restores_its_own():
    """xla-parallelize's hook runs on the package ``torch.distributed.tensor.parallel`` and wraps
    the function in its ``api``/``_api`` module: reloading that module must wrap the new function,
    and ``uninstall()`` must put back the reloaded function, not the one from before the reload."""
    out = run_json(
        """
        import importlib, json, torch, torchpatch
        import torch.distributed.tensor.parallel as tp
        api = importlib.import_module(tp.parallelize_module.__wrapped__.__module__)
        first = vars(api)["parallelize_module"]
        importlib.reload(api)
        again = vars(api)["parallelize_module"]
        own = getattr(again, "__wrapped__", None)
        torchpatch.uninstall()
        print(json.dumps({
            "module": api.__name__,
            "wrapped_before": hasattr(first, "__wrapped__"),
            "wrapped_after_reload": own is not None and own is not first.__wrapped__,
            "restored_reloaded_original": vars(api)["parallelize_module"] is own,
            "package_restored": tp.parallelize_module is own or not hasattr(tp.parallelize_module, "__wrapped__"),
        }))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert {k: v for k, v in out.items() if k != "module"} == {
        "wrapped_before": True, "wrapped_after_reload": True, "restored_reloaded_original": True,
        "package_restored": True,
    }, out


SUMMARY_JOB = """
import multiprocessing as mp, os, sys, torch
from torch.utils.data import DataLoader

def helper(q):
    import torch
    q.put(torch.ones(2).sum().item())

if __name__ == "__main__":
    children = os.environ["CHILDREN"] == "1"  # DataLoader workers and a helper, or the ranks alone
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1 if children else 0,
                        multiprocessing_context="spawn" if children else None)
    total = sum(int(b.sum()) for b in loader)
    got = 2.0
    if children:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=helper, args=(q,))
        p.start()
        got = q.get(timeout=120)
        p.join()
    # One write(2) of the whole line: both ranks share torchrun's stdout pipe, and print() may write
    # the text and its newline separately (unbuffered), so two ranks' lines could run together.
    os.write(1, f"rank {os.environ['RANK']} total {total} helper {got}\\n".encode())
"""


@pytest.mark.plumbing  # torchrun's agent, spawned DataLoader workers and helpers: how processes start, not patches
def test_one_summary_line_per_job(tmp_path):
    """torchrun (its agent imports torch too), 2 ranks, each with a spawn DataLoader worker and a
    spawned helper process: 7 processes activate torchpatch, rank 0 alone prints the line. At debug
    level every other line carries the rank of the process (or of the rank that spawned it), the
    agent's none. (Which lines each level shows: test_engine.py's test_log_levels.)"""
    proc = run_ranks(SUMMARY_JOB, tmp_path=tmp_path, launcher="torchrun",
                     env=clean_env(TORCHPATCH="1", TORCHPATCH_LOG="debug", CHILDREN="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank ")) == [
        "rank 0 total 28 helper 2.0", "rank 1 total 28 helper 2.0"]
    summaries = [line for line in proc.stderr.splitlines() if line.startswith("torchpatch: 0.1.0 on torch")]
    assert len(summaries) == 1, proc.stderr[-4000:]
    debug = [line for line in proc.stderr.splitlines() if " applied " in line and "on torch" not in line]
    assert any(line.startswith("torchpatch (rank 1): applied ") for line in debug), proc.stderr[-4000:]
    assert all(line.startswith(("torchpatch (rank 0): ", "torchpatch (rank 1): ", "torchpatch: applied "))
               for line in debug), debug

"""One record per patch: a patch that fails at any step, and ``uninstall()``, leave the process as
it would be without torchpatch. Checked without naming attributes: the final state of every module
of the fake target (tests/fixtures/fault_plugin) is described in full and compared with a run where
torchpatch is off, and the modules that existed before activation keep every object they had."""

import json

import pytest

from conftest import HERE, clean_env, make_plugin, run_py

pytestmark = [pytest.mark.torch_independent, pytest.mark.fresh_interpreter]  # activation and exit-time records; the engine on a stand-in target: the matrix leaves these to the quick suite

FAULT_PLUGIN = HERE / "fixtures" / "fault_plugin"
STEPS = ["builder", "alias", "symbol", "on_import", "during_import", "late"]

# Imports the target, snapshots it, activates torchpatch as the first `import torch` would, runs
# every step that demo-fault and demo-fault-dependent act on, then (argv[1] == "uninstall")
# uninstalls. Prints the outcome of each step, the patches' status, whether the modules imported
# before activation kept every object (identity), and a description of all target modules.
SCENARIO = r"""
import importlib, importlib.util, json, sys, types
import tp_fault_target, tp_fault_target.existing

def namespace(module):
    return {k: id(v) for k, v in vars(module).items()}

def snapshot():
    mods = {n: m for n, m in sys.modules.items() if n.startswith("tp_fault_target")}
    return {n: (id(m), namespace(m), id(getattr(m, "__loader__", None)), id(getattr(m, "__spec__", None)))
            for n, m in mods.items()}

def describe(value):
    if isinstance(value, types.ModuleType):
        return "module " + value.__name__
    if isinstance(value, (types.FunctionType, type)):
        return type(value).__name__ + " " + value.__module__ + "." + value.__qualname__
    if isinstance(value, (str, int, float, bool, list, tuple, type(None))):
        return repr(value)
    return type(value).__module__ + "." + type(value).__qualname__

def state():
    out = {}
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("tp_fault_target"):
            continue
        spec = module.__spec__
        out[name] = {
            "module": module.__name__,
            "loader": describe(module.__loader__),
            "spec": [spec.name, describe(spec.loader)] if spec is not None else None,
            "names": {k: describe(v) for k, v in sorted(vars(module).items())
                      if k not in ("__builtins__", "__cached__", "__file__", "__path__", "__doc__")},
            "class": type(module).__name__,
        }
    return out

before = snapshot()
importlib.util.find_spec("torch")  # activates torchpatch where TORCHPATCH=1
outcomes = {}
def step(name, fn):
    try:
        outcomes[name] = fn()
    except Exception as exc:
        outcomes[name] = type(exc).__name__

step("pkg", lambda: importlib.import_module("tp_fault_target.pkg").NAME)
step("dependent", lambda: tp_fault_target.DEPENDENT)
step("shim", lambda: importlib.import_module("tp_fault_target.shim.child").CHILD)
step("alias", lambda: importlib.import_module("tp_fault_target.moved").NAME)
step("alias_child", lambda: importlib.import_module("tp_fault_target.moved.sub").NAME)
step("symbol", lambda: tp_fault_target.SERVED)
step("also_symbol", lambda: tp_fault_target.ALSO_SERVED)
step("existing", lambda: tp_fault_target.existing.ORIGIN)  # patched at activation: already imported
step("greet", lambda: tp_fault_target.greet("x"))
step("during", lambda: importlib.import_module("tp_fault_target.during").DURING)
step("late", lambda: importlib.import_module("tp_fault_target.late").REGISTRY[:])

import torchpatch
status = {k: v for k, v in torchpatch.status().items() if k.startswith("demo-")}
if sys.argv[1:] == ["uninstall"]:
    torchpatch.uninstall()
after = snapshot()
# Every object a module held before activation is still there (new names: compared with native below).
kept = {n: n in after and after[n][0] == m and list(after[n][2:]) == rest and all(after[n][1].get(k) == v for k, v in ns.items())
        for n, (m, ns, *rest) in before.items()}
print(json.dumps({"outcomes": outcomes, "status": status, "kept": kept, "state": state(),
                  "finders": [type(f).__name__ for f in sys.meta_path if "torchpatch" in type(f).__module__]}))
"""


def _same_as_native(state: dict, native: dict) -> dict:
    """``state`` less the real submodules imported on the way (an alias child imports its target's
    submodule, which stays imported), for comparison with ``native``; fails on any served one."""
    state = json.loads(json.dumps(state))
    for name in [n for n in state if n not in native]:
        module = state.pop(name)
        assert module["spec"] == [name, module["loader"]] and "torchpatch" not in module["loader"], module
        parent, _, leaf = name.rpartition(".")
        if parent in state and state[parent]["names"].get(leaf) == f"module {name}":
            del state[parent]["names"][leaf]
    return state


def _scenario(fault: str = "", *args: str, **env: str) -> tuple:
    proc = run_py(SCENARIO, args=args, env=clean_env(PYTHONPATH=str(FAULT_PLUGIN), TP_FAULT=fault, **env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def native() -> dict:
    out, _ = _scenario()
    assert out["status"] == {} and out["outcomes"]["shim"] == "ModuleNotFoundError"
    return out


def test_every_step_applies_without_a_fault():
    out, stderr = _scenario("", TORCHPATCH="1")
    assert out["outcomes"] == {
        "pkg": "changed by demo-fault-dependent", "dependent": "dependent", "shim": True, "alias": "changed by demo-fault-dependent",
        "alias_child": "pkg.sub", "symbol": "served", "also_symbol": "also served", "existing": "patched",
        "greet": "HELLO X", "during": True, "late": ["demo-fault"],
    }
    assert out["status"] == {"demo-fault": "applied", "demo-fault-dependent": "applied"}, stderr


def test_uninstall_leaves_the_process_as_without_torchpatch(native):
    out, stderr = _scenario("", "uninstall", TORCHPATCH="1")
    assert out["status"] == {"demo-fault": "applied", "demo-fault-dependent": "applied"}
    assert out["finders"] == []
    assert all(out["kept"].values()), out["kept"]
    assert _same_as_native(out["state"], native["state"]) == native["state"], stderr


@pytest.mark.parametrize("fault", STEPS)
def test_a_fault_at_any_step_takes_the_patch_and_its_dependents_back_whole(native, fault):
    out, stderr = _scenario(fault, TORCHPATCH="1")
    assert out["status"] == {"demo-fault": "failed", "demo-fault-dependent": "failed"}, stderr
    assert all(out["kept"].values()), out["kept"]
    assert _same_as_native(out["state"], native["state"]) == native["state"], stderr
    failures = [line for line in stderr.splitlines() if "demo-fault failed" in line]
    cause = "tp_fault_target.raises always fails to import" if fault == "alias" else f"demo-fault fails at {fault}"
    assert len(failures) == 1 and cause in failures[0] and "taken back" in failures[0], stderr
    assert "patch demo-fault-dependent was taken back: it requires demo-fault, which failed" in stderr
    assert out["outcomes"]["late"] == []  # its registry entry never made, or removed again


@pytest.mark.parametrize("fault", [step for step in STEPS if step != "alias"])
def test_a_step_that_calls_sys_exit_is_a_fault_not_the_end_of_the_job(native, fault):
    out, stderr = _scenario(fault, TORCHPATCH="1", TP_FAULT_EXIT="1")  # the process goes on: exit status 0
    assert out["status"] == {"demo-fault": "failed", "demo-fault-dependent": "failed"}, stderr
    assert _same_as_native(out["state"], native["state"]) == native["state"], stderr
    failures = [line for line in stderr.splitlines() if "demo-fault failed" in line]
    assert len(failures) == 1 and f"SystemExit: demo-fault exits at {fault}" in failures[0], stderr


def test_strict_fails_at_the_first_fault_and_does_not_advise_strict():
    proc = run_py(SCENARIO, env=clean_env(PYTHONPATH=str(FAULT_PLUGIN), TP_FAULT="builder", TORCHPATCH="1",
                                          TORCHPATCH_STRICT="1"))
    assert proc.returncode == 0  # the scenario catches each step's exception ...
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["outcomes"]["shim"] == "PatchError"  # ... and the failing step raised PatchError
    assert "demo-fault failed while applying to module tp_fault_target.shim" in proc.stderr
    assert "TORCHPATCH_STRICT" not in proc.stderr


RAN_ON = "import importlib.util; importlib.util.find_spec('torch'); print('ran on')"  # activates, then goes on
BROKEN_PLUGINS = {
    "raises": ("raise ImportError('tp_broken_patches cannot be imported')\n",
               "skipping third-party patches from entry point tp_broken_patches = tp_broken_patches: "
               "tp_broken_patches cannot be imported",
               "torchpatch: activation failed: ImportError: tp_broken_patches cannot be imported"),
    "exits": ("import sys\nsys.exit(3)\n",
              "skipping third-party patches from entry point tp_broken_patches = tp_broken_patches: it called"
              " sys.exit(3) while loading",
              "torchpatch: activation failed: PluginError: third-party patches from entry point tp_broken_patches ="
              " tp_broken_patches: it called sys.exit(3) while loading"),
    "exits 0": ("import sys\nsys.exit()\n", "it called sys.exit(None) while loading",
                "it called sys.exit(None) while loading"),  # still a failing exit under strict
    "takes an id": ("from torchpatch import Patch\nPATCH = Patch(id='torch-six', summary='s', torch='>=1.0', upstream='u')\n",
                    "ignoring third-party patch 'torch-six' from entry point tp_broken_patches = tp_broken_patches:"
                    " the id is already taken",
                    "torchpatch: activation failed: PluginError: third-party patch 'torch-six' from entry point"
                    " tp_broken_patches = tp_broken_patches: the id is already taken"),
}


@pytest.mark.parametrize("fault", sorted(BROKEN_PLUGINS))
def test_a_broken_plugin_fails_a_strict_process_and_not_a_lenient_one(tmp_path, fault):
    """A plugin that raises or calls sys.exit() while loading, or registers an id already taken, is
    a warning (the job runs on without it) or, under TORCHPATCH_STRICT=1, a failed activation (exit 1)."""
    source, warning, error = BROKEN_PLUGINS[fault]
    env = dict(PYTHONPATH=str(make_plugin(tmp_path, "tp_broken_patches", source)), TORCHPATCH="1")
    lenient = run_py(RAN_ON, env=clean_env(**env))
    assert lenient.returncode == 0 and lenient.stdout.strip() == "ran on", lenient.stderr
    assert warning in lenient.stderr
    strict = run_py(RAN_ON, env=clean_env(TORCHPATCH_STRICT="1", **env))
    assert strict.returncode == 1 and "ran on" not in strict.stdout
    assert error in strict.stderr
    assert "set TORCHPATCH_STRICT=1" not in strict.stderr


def test_ctrl_c_while_a_plugin_loads_still_interrupts(tmp_path):
    env = clean_env(PYTHONPATH=str(make_plugin(tmp_path, "tp_interrupted", "raise KeyboardInterrupt\n")), TORCHPATCH="1")
    proc = run_py(RAN_ON, env=env)
    assert proc.returncode != 0 and "ran on" not in proc.stdout and "KeyboardInterrupt" in proc.stderr


def test_reload_applies_again_and_uninstall_restores_the_reloaded_originals():
    code = r"""
import importlib, importlib.util, json, sys
importlib.util.find_spec("torch")
import tp_fault_target, tp_fault_target.existing, torchpatch
first = tp_fault_target.greet
importlib.reload(tp_fault_target)
reloaded = vars(tp_fault_target)["greet"]
out = {"rewrapped": reloaded is not first and reloaded("x") == "HELLO X",
       "served": tp_fault_target.SERVED, "origin": importlib.reload(tp_fault_target.existing).ORIGIN}
own = reloaded.__wrapped__
torchpatch.uninstall()
out["restored"] = tp_fault_target.greet is own and tp_fault_target.greet("x") == "hello x"
out["served_gone"] = not hasattr(tp_fault_target, "SERVED") and "__getattr__" not in vars(tp_fault_target)
out["origin_after"] = tp_fault_target.existing.ORIGIN
print(json.dumps(out))
"""
    proc = run_py(code, env=clean_env(PYTHONPATH=str(FAULT_PLUGIN), TORCHPATCH="1"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "rewrapped": True, "served": "served", "origin": "patched", "restored": True, "served_gone": True,
        "origin_after": "native",
    }

"""The engine, exercised through the demo plugin (tests/fixtures/plugin): a third-party
distribution whose ``torchpatch.patches`` entry point serves patches for the fake ``tp_target``."""

import json

import pytest

from conftest import ARM, plugin_env, run_json, run_py

pytestmark = [pytest.mark.torch_independent, pytest.mark.fresh_interpreter]  # activation, its warnings and the summary line; the engine on a stand-in target: the matrix leaves these to the quick suite

PROBE = ARM + """
import json, importlib, torchpatch
out = {}
def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = type(exc).__name__ + ": " + str(exc)
import tp_target
attempt("missing", lambda: importlib.import_module("tp_target.missing").ANSWER)
attempt("existing", lambda: importlib.import_module("tp_target.existing").ORIGIN)
attempt("moved", lambda: [importlib.import_module("tp_target.moved") is importlib.import_module("tp_target.existing"),
                          importlib.import_module("tp_target.moved").__spec__.name])
attempt("pkg_child", lambda: importlib.import_module("tp_target.pkg_moved.sub") is importlib.import_module("tp_target.pkg.sub"))
attempt("pkg_reexport", lambda: [importlib.import_module("tp_target.pkg_moved.helper").helper(),
                                  importlib.import_module("tp_target.pkg").helper()])
attempt("ancient", lambda: importlib.import_module("tp_target.ancient").OLD)
attempt("served", lambda: tp_target.Served.origin)
attempt("needs_old", lambda: tp_target.NEEDS_OLD)
attempt("value", lambda: tp_target.VALUE)
attempt("greet", lambda: tp_target.greet("x"))
attempt("fragile", lambda: importlib.import_module("tp_target.fragile").LOADED)
attempt("fragile_flag_left", lambda: hasattr(tp_target, "_fragile_ok"))
attempt("broken", lambda: importlib.import_module("tp_target.broken_target").f())
out["status"] = torchpatch.status()
print(json.dumps(out))
"""


def test_native_without_torchpatch():
    out = run_json(PROBE, env=plugin_env())
    assert out["missing"].startswith("ModuleNotFoundError")
    assert out["existing"] == "native"
    assert out["moved"].startswith("ModuleNotFoundError")
    assert out["served"].startswith("AttributeError")
    assert out["greet"] == "hello x"
    assert out["fragile"] == "RuntimeError: tp_target.fragile needs its import-time fix"
    assert out["broken"] == 1
    assert out["status"] == {}


def test_every_mechanism_with_torchpatch():
    proc = run_py(PROBE, env=plugin_env(TORCHPATCH="1"))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["missing"] == 42  # shim module for a module that does not exist
    assert out["existing"] == "native"  # a shim is never served over an existing module
    assert out["moved"] == [True, "tp_target.existing"]  # an alias is the module itself
    assert out["pkg_child"] is True  # a submodule under an alias package is the target's, not a copy
    # Importing a submodule under the alias leaves the target's re-exported function of that name.
    assert out["pkg_reexport"] == ["function", "function"]
    assert out["ancient"].startswith("ModuleNotFoundError")  # patch for torch<1.0 does not apply
    assert out["served"] == "torchpatch"  # missing symbol served
    assert out["needs_old"] is True
    assert out["value"] == 1  # existing symbol untouched
    assert out["greet"] == "HELLO X"  # behaviour patch through wrapt
    assert out["fragile"] is True and out["fragile_flag_left"] is False  # import-time fix, undone after
    # Fail-safe: the broken patch's partial change is taken back, the import goes on natively.
    assert out["broken"] == 1
    assert {k: v for k, v in out["status"].items() if k.startswith("demo-")} == {
        "demo-broken": "failed",
        "demo-import-time": "applied",
        "demo-needs-old": "applied",  # its requirement does not apply to this torch: no requirement
        "demo-shim": "applied",
        "demo-symbol": "applied",
        "demo-wrap": "applied",
    }
    failures = [line for line in proc.stderr.splitlines() if "demo-broken" in line]
    assert len(failures) == 1, proc.stderr
    assert "RuntimeError: demo patch is broken" in failures[0] and "TORCHPATCH_STRICT=1" in failures[0]


def test_strict_turns_a_failing_patch_into_an_error():
    proc = run_py(ARM + "import tp_target.broken_target", env=plugin_env(TORCHPATCH="1", TORCHPATCH_STRICT="1"))
    assert proc.returncode != 0
    assert "torchpatch.PatchError" in proc.stderr or "PatchError" in proc.stderr
    assert "demo-broken failed while applying to tp_target.broken_target" in proc.stderr


def test_uninstall_takes_back_shims_symbols_and_wrappers():
    out = run_json(
        """
        import importlib.util; importlib.util.find_spec("torch")
        import json, sys, torchpatch, tp_target, tp_target.missing
        original = tp_target.greet.__wrapped__
        served = tp_target.Served
        torchpatch.uninstall()
        try:
            import tp_target.missing as again
            shim = "still importable"
        except ImportError:
            shim = "gone"
        print(json.dumps({
            "greet": tp_target.greet is original,
            "served": hasattr(tp_target, "Served"),
            "getattr": hasattr(tp_target, "__getattr__"),
            "shim": shim,
        }))
        """,
        env=plugin_env(TORCHPATCH="1"),
    )
    assert out == {"greet": True, "served": False, "getattr": False, "shim": "gone"}


STATUS = ARM + "import json, torchpatch, tp_target; print(json.dumps(torchpatch.status()))"


@pytest.mark.parametrize(
    "flags, on, off",
    [
        ({"TORCHPATCH_DISABLE": "demo-shim"}, ["demo-wrap"], ["demo-shim"]),
        ({"TORCHPATCH_DISABLE": "*"}, [], ["demo-shim", "demo-wrap", "demo-symbol"]),
        ({"TORCHPATCH_DISABLE": "*", "TORCHPATCH_DEMO_SHIM": "1"}, ["demo-shim"], ["demo-wrap"]),
        ({"TORCHPATCH_DEMO_SHIM": "0"}, ["demo-wrap"], ["demo-shim"]),
        ({"TORCHPATCH_DEMO_SHIM": "off"}, ["demo-wrap"], ["demo-shim"]),
        # enabling a patch enables what it requires
        ({"TORCHPATCH_ENABLE": "demo-wrap"}, ["demo-wrap", "demo-symbol"], ["demo-shim"]),
        # disabling a required patch disables its dependents
        ({"TORCHPATCH_DISABLE": "demo-symbol"}, ["demo-shim"], ["demo-wrap", "demo-symbol"]),
    ],
)
def test_opt_outs(flags, on, off):
    status = run_json(STATUS, env=plugin_env(TORCHPATCH="1", **flags))
    for pid in on:
        assert pid in status, (flags, status)
    for pid in off:
        assert pid not in status, (flags, status)


def test_disabling_a_requirement_says_what_it_disables():
    proc = run_py(STATUS, env=plugin_env(TORCHPATCH="1", TORCHPATCH_DISABLE="demo-symbol"))
    assert "turning off demo-symbol also turns off demo-wrap, which needs it" in proc.stderr


def test_unknown_ids_warn_with_the_valid_ids_and_the_run_goes_on():
    proc = run_py(STATUS, env=plugin_env(TORCHPATCH="1", TORCHPATCH_DISABLE="demo-shmi", TORCHPATCH_DEMO_SIHM="0"))
    assert proc.returncode == 0
    assert "TORCHPATCH_DISABLE names unknown patch id(s) demo-shmi; valid ids:" in proc.stderr
    assert "demo-shim" in proc.stderr and "torch-six" in proc.stderr
    assert "unknown variable(s) TORCHPATCH_DEMO_SIHM" in proc.stderr and "TORCHPATCH_DEMO_SHIM" in proc.stderr
    assert "demo-shim" in json.loads(proc.stdout.splitlines()[-1])


SUMMARY = "import torch, tp_target.missing"


def test_summary_line_on_rank_zero_only():
    rank0 = run_py(SUMMARY, env=plugin_env(TORCHPATCH="1", RANK="0"))
    lines = [line for line in rank0.stderr.splitlines() if "applied" in line]
    assert len(lines) == 1, rank0.stderr
    assert lines[0].startswith("torchpatch: 0.1.0 on torch ") and "demo-shim" in lines[0] and "Python 3." in lines[0]
    rank1 = run_py(SUMMARY, env=plugin_env(TORCHPATCH="1", RANK="1"))
    assert "applied" not in rank1.stderr


def test_no_summary_in_processes_that_never_import_torch():
    proc = run_py(ARM + "import sys, torchpatch, tp_target.missing; print(torchpatch.status()['demo-shim'])",
                  env=plugin_env(TORCHPATCH="1"))
    assert proc.stdout.strip() == "applied" and proc.stderr == ""


@pytest.mark.parametrize("level, debug_lines, summary_lines", [("off", 0, 0), ("warning", 0, 0), ("info", 0, 1), ("debug", 4, 1)])
def test_log_levels(level, debug_lines, summary_lines):
    lines = run_py(SUMMARY, env=plugin_env(TORCHPATCH="1", TORCHPATCH_LOG=level)).stderr.splitlines()
    assert len([line for line in lines if line.startswith("torchpatch: applied demo-")]) == debug_lines, lines
    assert len([line for line in lines if line.startswith("torchpatch: 0.1.0 on torch")]) == summary_lines, lines


@pytest.mark.parametrize("enable, disable, named", [("demo-shim,demo-wrap", " demo-wrap", "demo-wrap"),
                                                     ("demo-shim", "*", "demo-shim"), ("*", "demo-shim,demo-wrap", "demo-shim, demo-wrap")])
def test_an_id_in_both_lists_is_on_with_one_warning(enable, disable, named):
    proc = run_py(STATUS, env=plugin_env(TORCHPATCH="1", TORCHPATCH_ENABLE=enable, TORCHPATCH_DISABLE=disable))
    assert proc.returncode == 0, proc.stderr
    for patch_id in named.split(", "):
        assert patch_id in json.loads(proc.stdout.splitlines()[-1])
    warnings = [line for line in proc.stderr.splitlines() if "TORCHPATCH_DISABLE" in line]
    assert warnings == [f"torchpatch: TORCHPATCH_ENABLE and TORCHPATCH_DISABLE both name {named} ('*' names every id):"
                        " TORCHPATCH_ENABLE wins and turns on what it names (a TORCHPATCH_<ID> switch beats both lists);"
                        " name each id in one list only"], proc.stderr


def test_an_empty_enable_list_warns_that_everything_is_off():
    proc = run_py(STATUS, env=plugin_env(TORCHPATCH="1", TORCHPATCH_ENABLE=""))
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1]) == {}
    assert "TORCHPATCH_ENABLE is set but names no patch, so every patch is off" in proc.stderr


@pytest.mark.parametrize("log", ["warning", "off"])
def test_flag_warnings_follow_the_log_level(log):
    env = plugin_env(TORCHPATCH="1", TORCHPATCH_STRICT="maybe", TORCHPATCH_DEMO_SHIM="perhaps",
                     TORCHPATCH_ENABLE="", TORCHPATCH_LOG=log)
    proc = run_py(STATUS, env=env)
    assert proc.returncode == 0
    if log == "off":
        assert proc.stderr == ""
    else:
        assert "ignoring TORCHPATCH_STRICT='maybe'" in proc.stderr
        assert "ignoring TORCHPATCH_DEMO_SHIM='perhaps'" in proc.stderr


def test_a_change_made_after_the_hook_returned_is_undone_in_order_and_refused_once_taken_back():
    """A hook that keeps its patcher and wraps later (on the first use of a feature): the later wrap
    joins the patch's record when made, so ``uninstall()`` unwinds it after a wrap of the same
    function that another patch made in between (newest first); once undone, the patcher refuses."""
    from torchpatch._patch import Patcher
    from torchpatch._record import Journal

    class Target:
        def f(self):
            return "f"

    original = vars(Target)["f"]
    journal = Journal()
    mine, other = Patcher(), Patcher()
    journal.record("mine").add(mine.undo)  # the hook ran first ...
    mine.settle(journal.record("mine").add)
    journal.record("other").add(other.undo)
    other.wrap(Target, "f", lambda wrapped, instance, args, kwargs: "other(" + wrapped(*args, **kwargs) + ")")
    other.settle(journal.record("other").add)
    mine.wrap(Target, "f", lambda wrapped, instance, args, kwargs: "mine(" + wrapped(*args, **kwargs) + ")")  # ... wraps later
    assert Target().f() == "mine(other(f))"
    assert journal.undo_all() == []
    assert vars(Target)["f"] is original
    with pytest.raises(RuntimeError, match="taken back"):
        mine.wrap(Target, "f", lambda wrapped, instance, args, kwargs: "late")
    assert vars(Target)["f"] is original

    reloaded = Patcher()  # a reload undoes the hook's run, later changes included
    reloaded.settle(Journal().record("mine").add)
    reloaded.setattr(Target, "g", 1)
    reloaded.undo()
    assert not hasattr(Target, "g")

"""Activation: the start-up hook, on/off parsing, explicit install(), idempotence, zero cost off."""

import json

import pytest

from conftest import REPO, TORCH, clean_env, run_json, run_py

# activation at interpreter start, the .pth and sitecustomize paths; the tests marked plumbing run on the matrix torches
# of conftest.PLUMBING_MINORS, the two whose outcome depends on which patches apply here on every torch
pytestmark = pytest.mark.fresh_interpreter

STATE = """
import copy, json, sys
found = [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path]
print(json.dumps({
    "modules": sorted(m for m in sys.modules if "torchpatch" in m),
    "finders": [f for f in found if "torchpatch" in f],
    "deepcopy": copy.deepcopy.__module__ + "." + type(copy.deepcopy).__name__,
}))
"""


@pytest.mark.plumbing
@pytest.mark.parametrize("value", [None, "0", "false", "No", "OFF", ""])
def test_off_means_nothing_at_all(value):
    state = run_json(STATE, env=clean_env(TORCHPATCH=value))
    # With the variable set, the .pth line hands its value to the start-up module (the one place
    # that spells the accepted values); the torchpatch package itself is never imported.
    assert state == {"modules": [] if value is None else ["_torchpatch_startup"], "finders": [],
                     "deepcopy": "copy.function"}


@pytest.mark.plumbing
def test_off_leaves_torch_untouched():
    state = run_json(
        """
        import json, sys, torch, torch.distributed as dist
        import torch._C._distributed_c10d as c10d
        print(json.dumps({
            "modules": sorted(m for m in sys.modules if "torchpatch" in m),
            "deepcopy": [hasattr(getattr(c10d, n), "__deepcopy__") for n in ("ProcessGroup", "Backend") if hasattr(c10d, n)],
        }))
        """
    )
    assert state["modules"] == []
    assert not any(state["deepcopy"])


@pytest.mark.plumbing
@pytest.mark.parametrize("value", ["1", "true", "YES", "On"])
def test_on_spellings_arm_and_torch_activates(value):
    code = """
        import importlib.util, json, sys
        def state():
            return {"modules": sorted(m for m in sys.modules if m.startswith(("torchpatch", "_torchpatch"))),
                    "finders": [type(f).__module__ + "." + type(f).__name__ for f in sys.meta_path
                                if "torchpatch" in type(f).__module__]}
        armed = state()
        importlib.util.find_spec("torch")  # the first step of `import torch`
        active = state()
        print(json.dumps({"armed": armed, "active": active, "torch": "torch" in sys.modules}))
    """
    out = run_json(code, env=clean_env(TORCHPATCH=value))
    assert out["armed"] == {"modules": ["_torchpatch_startup"], "finders": ["_torchpatch_startup._FirstTorchImport"]}
    assert "torchpatch" in out["active"]["modules"]
    assert out["active"]["finders"] == ["torchpatch._hooks.ImportWatcher", "torchpatch._hooks.ShimFinder"]
    assert out["torch"] is False  # activation itself imports nothing of torch


@pytest.mark.plumbing
@pytest.mark.parametrize("log", [None, "off"])
def test_unknown_value_warns_once_and_stays_off(log):
    proc = run_py(STATE, env=clean_env(TORCHPATCH="maybe", TORCHPATCH_LOG=log))
    assert proc.returncode == 0
    warnings = [line for line in proc.stderr.splitlines() if "TORCHPATCH" in line]
    if log == "off":
        assert proc.stderr == ""
    else:
        assert len(warnings) == 1, proc.stderr
        assert "TORCHPATCH='maybe'" in warnings[0] and "1/true/yes/on" in warnings[0] and "0/false/no/off" in warnings[0]
    assert '"modules": ["_torchpatch_startup"], "finders": []' in proc.stdout  # not the package


@pytest.mark.plumbing
def test_process_that_never_imports_torch_loads_nothing_of_torchpatch():
    code = "import json, sys; print(json.dumps(sorted(m for m in sys.modules if 'torchpatch' in m)))"
    assert run_json(code, env=clean_env(TORCHPATCH="1")) == ["_torchpatch_startup"]
    code = "import json, torch, torchpatch; print(json.dumps([torchpatch.is_installed(), len(torchpatch.status())]))"
    installed, armed = run_json(code, env=clean_env(TORCHPATCH="1"))
    assert installed and armed > 0


@pytest.mark.plumbing
def test_explicit_install_ignores_the_variable_but_not_the_opt_outs():
    code = """
        import json, torchpatch
        torchpatch.install()
        import torch
        try:
            import torch._six
            six = True
        except ImportError:
            six = False
        print(json.dumps({"installed": torchpatch.is_installed(), "six": six}))
    """
    from conftest import torch_matches

    served = torch_matches(">=2.0")  # 1.13 has torch._six natively
    assert run_json(code, env=clean_env(TORCHPATCH="0")) == {"installed": True, "six": True}
    off = run_json(code, env=clean_env(TORCHPATCH_DISABLE="torch-six"))
    assert off == {"installed": True, "six": not served}


@pytest.mark.plumbing
def test_pth_sitecustomize_and_install_activate_once(tmp_path):
    (tmp_path / "sitecustomize.py").write_text((REPO / "src" / "torchpatch" / "_bootstrap" / "sitecustomize.py").read_text())
    state = run_json(
        """
        import json, sys, torchpatch
        torchpatch.install(); torchpatch.install()
        kinds = [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("torchpatch")]
        print(json.dumps(kinds))
        """,
        env=clean_env(TORCHPATCH="1", PYTHONPATH=str(tmp_path)),
    )
    assert state == ["ImportWatcher", "ShimFinder"]


def test_uninstall_restores_everything():
    state = run_json(
        """
        import copy, json, sys, torchpatch
        import torch.distributed as dist
        import torch._C._distributed_c10d as c10d
        before = hasattr(c10d.ProcessGroup, "__deepcopy__")
        torchpatch.uninstall()
        print(json.dumps({
            "before": before,
            "after": hasattr(c10d.ProcessGroup, "__deepcopy__"),
            "finders": [type(f).__name__ for f in sys.meta_path if type(f).__module__.startswith("torchpatch")],
            "installed": torchpatch.is_installed(),
        }))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert state == {"before": True, "after": False, "finders": [], "installed": False}


def test_activation_imports_only_the_patches_that_apply_here():
    """install() imports the catalogue modules whose patches can apply to this torch and Python (the
    index says which), not the others; flags may still name a patch left out, without a warning."""
    from torchpatch._patch import switch_name
    from torchpatch._registry import catalogue_index
    from torchpatch._versions import matches, python_version

    index = catalogue_index()
    here = sorted(m for m, declared in index.items()
                  if any(matches(t, TORCH) and (not py or matches(py, python_version())) for t, py in declared.values()))
    left_out = sorted(i for m, declared in index.items() if m not in here for i in declared)
    assert here and left_out  # every matrix torch has both
    code = """
        import importlib.util, json, sys
        importlib.util.find_spec("torch")
        names = [m[len("torchpatch.patches."):] for m in sys.modules if m.startswith("torchpatch.patches.") and "._" not in m]
        loaded = sorted(n for n in names if n.count(".") == 1)  # <subsystem>.<patch module>
        print(json.dumps(loaded))
    """
    proc = run_py(code, env=clean_env(TORCHPATCH="1", TORCHPATCH_DISABLE=left_out[0],
                                      **{switch_name(left_out[-1]): "0"}))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == here
    assert "unknown" not in proc.stderr, proc.stderr
    typo = run_py(code, env=clean_env(TORCHPATCH="1", TORCHPATCH_DISABLE="no-such-patch"))
    assert "unknown patch id(s) no-such-patch" in typo.stderr and left_out[0] in typo.stderr, typo.stderr

"""The installed wheel: what it ships, what it depends on, and the PEP 829 start-up entry point."""

import subprocess
import sys

if sys.version_info >= (3, 10):
    from importlib import metadata
else:
    import importlib_metadata as metadata

from conftest import REPO, clean_env, run_json

DIST = metadata.distribution("torchpatch")
FILES = {str(f) for f in DIST.files}


def test_tests_run_against_the_built_wheel_not_the_source_tree():
    import torchpatch

    assert not torchpatch.__file__.startswith(str(REPO / "src"))
    assert "direct_url.json" not in " ".join(FILES) or '"editable": true' not in (DIST.read_text("direct_url.json") or "")


def test_wheel_ships_engine_catalogue_and_start_up_hooks():
    for path in ("torchpatch/__init__.py", "torchpatch/patches/__init__.py", "torchpatch/patches/torch_six.py",
                 "torchpatch/patches/processgroup_deepcopy.py", "torchpatch/_bootstrap/sitecustomize.py",
                 "torchpatch.pth", "torchpatch.start", "_torchpatch_startup.py"):
        assert path in FILES, path
    assert not any(f.startswith("patches/") for f in FILES)  # no top-level package that could collide


def test_torch_is_not_a_dependency():
    requires = DIST.requires or []
    assert not any(r.split(";")[0].strip().lower().startswith("torch") for r in requires), requires
    assert any(r.startswith("wrapt") for r in requires) and any(r.startswith("packaging") for r in requires)
    assert any(r.startswith("pytest") and "extra ==" in r and "test" in r for r in requires)


def test_pep_829_start_entry_point_is_inert_when_off():
    start = (DIST.locate_file("torchpatch.start")).read_text().strip()
    assert start == "_torchpatch_startup:start"
    code = f"""
        import json, pkgutil, sys
        pkgutil.resolve_name({start!r})()
        import importlib.util; importlib.util.find_spec("torch")  # the first step of `import torch`
        print(json.dumps(sorted(m for m in sys.modules if m == "torchpatch" or m.startswith("torchpatch."))))
    """
    assert run_json(code, env=clean_env()) == []
    assert "torchpatch" in run_json(code, env=clean_env(TORCHPATCH="1"))


def test_readme_patch_table_is_generated_from_the_patches():
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "patch_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

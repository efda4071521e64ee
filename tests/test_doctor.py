"""``torchpatch doctor`` in environments made for it: a fresh virtual environment whose only
torchpatch is a ``pip install --target`` copy of the built wheel on PYTHONPATH (no .pth is processed
there), with or without its dependencies, once or twice; its report, hazards and exit status."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env

pytestmark = [pytest.mark.torch_independent, pytest.mark.fresh_interpreter]  # what a fresh interpreter finds installed; a venv without torch: the matrix leaves these to the quick suite

if sys.version_info >= (3, 10):
    from importlib import metadata
else:
    import importlib_metadata as metadata

OK, HAZARD, MISSING = 0, 1, 3


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, wheel):
    """A fresh venv (no torch, no torchpatch), two --target copies of the wheel, and a directory that
    holds only torchpatch's dependencies (wrapt, packaging), taken from this test environment."""
    root = tmp_path_factory.mktemp("doctor")
    for name in ("target", "second"):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root / name),
                        str(wheel)], check=True)
    deps = root / "deps"
    deps.mkdir()
    for name in ("wrapt", "packaging"):
        dist = metadata.distribution(name)
        info = Path(str(dist._path))
        (deps / info.name).symlink_to(info)
        (deps / name).symlink_to(info.parent / name)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    return root


def doctor(fresh, *path, env=None, flags=(), command=None):
    """``torchpatch doctor --json`` by the fresh venv's python, with PYTHONPATH = ``path`` under ``fresh``."""
    python = str(fresh / "venv" / "bin" / "python")
    env = clean_env(PYTHONPATH=os.pathsep.join(str(fresh / p) for p in path), **(env or {}))
    cmd = command or [python, *flags, "-m", "torchpatch", "doctor", "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit"], proc.stderr
    return report


def test_missing_dependency_is_named_and_exits_3(fresh):
    report = doctor(fresh, "target")
    assert report["wrapt"] is None and report["packaging"] is None
    assert report["missing_dependencies"] == ["wrapt>=1.14", "packaging>=21"]
    assert report["exit"] == MISSING
    proc = subprocess.run([str(fresh / "venv" / "bin" / "python"), "-m", "torchpatch", "doctor"], capture_output=True,
                          text=True, env=clean_env(PYTHONPATH=str(fresh / "target")), timeout=120)
    assert proc.returncode == MISSING
    assert "wrapt        MISSING: torchpatch cannot patch without it; pip install 'wrapt>=1.14'" in proc.stdout
    assert "None" not in proc.stdout


def test_a_sound_environment_exits_0_and_says_how_to_tell_it_acted(fresh):
    report = doctor(fresh, "target", "deps")
    assert report["missing_dependencies"] == [] and report["hazards"] == [] and report["exit"] == OK
    assert report["wrapt"] == metadata.version("wrapt")
    assert report["copies"]["packages"] == [str((fresh / "target" / "torchpatch").resolve())]
    assert report["startup_hook"] == []  # a --target install: no .pth is processed
    assert report["activation"] == {"on": False, "hook_ran": False,
                                    "text": "activation is OFF here (TORCHPATCH is not set): nothing is applied"}
    assert "torchpatch.is_installed()" in report["how_to_tell"] and "prints one line when it exits" in report["how_to_tell"]


def test_torchpatch_on_but_no_start_up_hook_is_a_hazard(fresh):
    """TORCHPATCH=1 with a --target install (no .pth), or python -S: the hook never runs."""
    for flags in ((), ("-S",)):
        report = doctor(fresh, "target", "deps", env={"TORCHPATCH": "1"}, flags=flags)
        assert report["activation"]["on"] is True and report["activation"]["hook_ran"] is False, flags
        hazard, = report["hazards"]
        assert hazard.startswith("TORCHPATCH is on but torchpatch's start-up hook did not run in this process")
        assert "torchpatch run -- CMD" in hazard and report["exit"] == HAZARD
    # through `torchpatch run`, whose bootstrap is that hook: fine
    python = str(fresh / "venv" / "bin" / "python")
    run = [python, str(fresh / "target" / "bin" / "torchpatch"), "run", "--", python, "-m", "torchpatch", "doctor", "--json"]
    report = doctor(fresh, "target", "deps", command=run)
    assert report["activation"]["hook_ran"] is True and report["hazards"] == [] and report["exit"] == OK


def test_two_installed_copies_are_a_hazard(fresh):
    report = doctor(fresh, "target", "second", "deps")
    first, second = (str((fresh / n / "torchpatch").resolve()) for n in ("target", "second"))
    assert report["copies"]["packages"] == [first, second]
    assert len(report["copies"]["distributions"]) == 2
    hazard, = report["hazards"]
    assert hazard.startswith("2 installed copies of torchpatch") and f"package {first} (imported)" in hazard
    assert f"package {second} (shadowed)" in hazard and report["exit"] == HAZARD


def test_two_distributions_in_one_directory_are_a_hazard(fresh, tmp_path):
    """A leftover dist-info of another version beside the installed one (a half-done upgrade)."""
    copy = tmp_path / "target"
    shutil.copytree(fresh / "target", copy, symlinks=True)
    info, = copy.glob("torchpatch-*.dist-info")
    old = copy / "torchpatch-0.0.1.dist-info"
    shutil.copytree(info, old)
    (old / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", "Version: 0.0.1", (old / "METADATA").read_text()))
    report = doctor(fresh, str(copy), "deps")
    assert len(report["copies"]["packages"]) == 1 and len(report["copies"]["distributions"]) == 2
    assert report["hazards"][0].startswith("2 installed copies of torchpatch") and report["exit"] == HAZARD


def test_exit_codes_are_documented():
    proc = subprocess.run([sys.executable, "-m", "torchpatch", "doctor", "--help"], capture_output=True, text=True,
                          env=clean_env(), timeout=60)
    text = " ".join(proc.stdout.split())
    assert "Exit status: 0 when nothing is wrong; 1 when a hazard is found" in text
    assert "3 when a run-time dependency of torchpatch (wrapt, packaging) is missing" in text

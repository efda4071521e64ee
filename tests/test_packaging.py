"""The wheel: what it ships, what it depends on, and the PEP 829 start-up entry point; the sdist and the
wheel built from it; one source for the version; an editable install; the Pythons the code claims.

The nox sessions install the wheel they built (``TORCHPATCH_TEST_WHEEL``), and the tests judge that wheel.
Where torchpatch is installed editable (``pip install -e .``), what only a wheel can tell (its files, its
metadata) is judged on a wheel built from the working tree (the fixture ``wheel``)."""

import json
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

if sys.version_info >= (3, 10):
    from importlib import metadata
else:
    import importlib_metadata as metadata

from conftest import REPO, WHEEL, clean_env, run_json

pytestmark = pytest.mark.torch_independent  # the wheel and the sdist: the matrix leaves these to the quick suite

DIST = metadata.distribution("torchpatch")  # as installed
EDITABLE = json.loads(DIST.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable", False)
# The Pythons the suite runs on: the classifiers name these and no other (requires-python may admit older ones).
TESTED_PYTHONS = ["3.11"]


@pytest.fixture(scope="module")
def shipped(wheel: Path) -> metadata.Distribution:
    """torchpatch as its wheel ships it: the nox session's installed wheel, else one built from the working tree."""
    info = next(p for p in zipfile.Path(wheel).iterdir() if p.name.endswith(".dist-info"))
    return metadata.PathDistribution(info)


@pytest.fixture(scope="module")
def files(shipped: metadata.Distribution) -> set:
    return {str(f) for f in shipped.files}


def test_tests_run_against_the_installed_wheel_or_this_working_tree():
    """The nox sessions: the wheel they installed, nothing of src/. An editable install: this working
    tree's src/, for the package, the start-up module and ``torchpatch run``'s bootstrap alike."""
    import _torchpatch_startup
    import torchpatch
    from torchpatch._run import BOOTSTRAP

    src = REPO / "src"
    served = {Path(path).resolve() for path in (torchpatch.__file__, _torchpatch_startup.__file__, BOOTSTRAP)}
    if EDITABLE:
        assert all(src in path.parents for path in served), served
    else:
        assert WHEEL and not any(src in path.parents for path in served), (WHEEL, served)


def test_wheel_ships_engine_catalogue_and_start_up_hooks(files):
    for path in ("torchpatch/__init__.py", "torchpatch/patches/__init__.py", "torchpatch/patches/core/torch_six.py",
                 "torchpatch/patches/collectives/processgroup_deepcopy.py", "torchpatch/_bootstrap/sitecustomize.py",
                 "torchpatch.pth", "torchpatch.start", "_torchpatch_startup.py"):
        assert path in files, path
    assert not any(f.startswith("patches/") for f in files)  # no top-level package that could collide


def test_the_top_level_sitecustomize_example_is_the_bootstrap_torchpatch_run_uses():
    """The file the cluster docs tell admins to copy, at the top of the repository and the sdist, is byte for
    byte the bootstrap ``torchpatch run`` puts first on PYTHONPATH (the package's own copy)."""
    from torchpatch._run import BOOTSTRAP

    example = (REPO / "sitecustomize_example.py").read_bytes()
    assert example == (Path(BOOTSTRAP) / "sitecustomize.py").read_bytes()
    assert example == (REPO / "src" / "torchpatch" / "_bootstrap" / "sitecustomize.py").read_bytes()


def test_torch_is_not_a_dependency(shipped):
    requires = shipped.requires or []
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


def test_wheel_ships_license_and_type_marker_and_metadata(shipped, files):
    assert f"torchpatch-{shipped.version}.dist-info/licenses/LICENSE" in files
    assert "torchpatch/py.typed" in files
    assert shipped.read_text("licenses/LICENSE") == (REPO / "LICENSE").read_text()
    assert "Copyright (c) 2026, the torchpatch authors" in (REPO / "LICENSE").read_text()
    meta = shipped.metadata
    assert meta["License-Expression"] == "BSD-3-Clause"
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert {"Homepage", "Source", "Issues", "Changelog", "Documentation"} <= set(urls), urls
    classifiers = meta.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and "Programming Language :: Python :: 3 :: Only" in classifiers
    pythons = [c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert pythons == TESTED_PYTHONS, pythons
    if WHEEL:  # a nox session, as CI runs it: on a Python the classifiers name
        assert f"{sys.version_info[0]}.{sys.version_info[1]}" in pythons, pythons


def test_one_source_for_the_version():
    import torchpatch
    from torchpatch._version import __version__

    assert DIST.version == torchpatch.__version__ == __version__
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M) and not re.search(r"^version\s*=", pyproject, re.M)
    assert 'path = "src/torchpatch/_version.py"' in pyproject
    sources = [p for p in (REPO / "src").rglob("*.py") if re.search(r"^__version__\s*=", p.read_text(), re.M)]
    assert sources == [REPO / "src" / "torchpatch" / "_version.py"]
    proc = subprocess.run([sys.executable, "-m", "torchpatch", "--version"], capture_output=True, text=True,
                          env=clean_env())
    assert proc.stdout.strip() == f"torchpatch {DIST.version}"


def test_sdist_and_the_wheel_built_from_it_ship_license_changelog_and_type_marker(tmp_path):
    """`python -m build`: the sdist first, then the wheel from the unpacked sdist (as pip builds
    from PyPI), so what the sdist lacks, the wheel lacks too."""
    subprocess.run([sys.executable, "-m", "build", "-q", "--outdir", str(tmp_path), str(REPO)], check=True,
                   capture_output=True)
    sdist, = tmp_path.glob("torchpatch-*.tar.gz")
    wheel, = tmp_path.glob("torchpatch-*.whl")
    version = DIST.version
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"torchpatch-{version}/PKG-INFO").read().decode()
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "src/torchpatch/py.typed",
            "src/torchpatch/_version.py", "sitecustomize_example.py"} <= names, sorted(names)
    assert f"Version: {version}" in pkg_info and "License-File: LICENSE" in pkg_info
    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
        license_text = whl.read(f"torchpatch-{version}.dist-info/licenses/LICENSE").decode()
    assert {"torchpatch/py.typed", "torchpatch/_version.py", "torchpatch.pth", "_torchpatch_startup.py"} <= files
    assert license_text == (REPO / "LICENSE").read_text()


def test_an_editable_install_serves_the_working_tree(tmp_path):
    """``pip install -e .`` into a fresh venv copies only the start-up hook's site files (hatch_build.py):
    with TORCHPATCH=1 the start-up module is armed from src/, and ``torchpatch run``'s bootstrap
    sitecustomize is src/torchpatch/_bootstrap's, so an edit to any of them is seen at the next start."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "-e",
                    str(REPO)], check=True, capture_output=True)
    probe = ("import json, sys, torchpatch; startup = sys.modules['_torchpatch_startup']; "
             "print(json.dumps([m.__file__ for m in (startup, torchpatch, sys.modules['sitecustomize'])] + [startup.pending()]))")
    proc = subprocess.run([str(venv / "bin" / "torchpatch"), "run", "--", str(venv / "bin" / "python"), "-c", probe],
                          env=clean_env(PYTHONPATH=None), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *served, armed = json.loads(proc.stdout.strip().splitlines()[-1])
    src = REPO / "src"
    assert served == [str(src / "_torchpatch_startup.py"), str(src / "torchpatch" / "__init__.py"),
                      str(src / "torchpatch" / "_bootstrap" / "sitecustomize.py")] and armed


def test_the_code_needs_no_python_newer_than_requires_python_admits():
    """What pip installs on (requires-python) and what is tested (the classifiers) differ: the code in
    src/ (and the build hook) uses no syntax, module, function or argument newer than the oldest Python
    admitted (vermin), so that it at least imports and runs there."""
    oldest = re.search(r'^requires-python = ">=(3\.\d+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    vermin = Path(sysconfig.get_path("scripts")) / "vermin"
    if not vermin.exists():  # nox installs the test extra; a venv made otherwise may lack it
        pytest.skip("vermin, of the test extra, is not installed: pip install -e '.[test]'")
    proc = subprocess.run([str(vermin), f"--target={oldest}-", "--no-tips", "--violations", str(REPO / "src"),
                           str(REPO / "hatch_build.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr

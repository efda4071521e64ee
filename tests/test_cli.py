"""The ``torchpatch`` command: list, doctor, run, --help."""

import json
import re
import subprocess
import sys

from conftest import REPO, TORCH, clean_env, run_json, run_py, torch_matches
from torchpatch import _versions
from torchpatch.patches import NEWEST_TESTED_TORCH


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "torchpatch", *args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=120)


def test_help_answers_the_questions():
    out = cli("--help").stdout
    for text in ("TORCHPATCH=1", "TORCHPATCH_DISABLE", "TORCHPATCH_ENABLE", "TORCHPATCH_<ID>",
                 "TORCHPATCH_STRICT", "TORCHPATCH_LOG", "list", "doctor", "run"):
        assert text in out
    assert "--target" in cli("run", "--help").stdout


def test_list_json_reports_applicability_and_switches():
    rows = {r["id"]: r for r in json.loads(cli("list", "--json").stdout)}
    assert rows["torch-six"]["applies"] is torch_matches(">=2.0")
    assert rows["processgroup-deepcopy"]["applies"] is True
    assert all(r["enabled"] and r["enabled_reason"] == "on by default" for r in rows.values())
    off = {r["id"]: r for r in json.loads(cli("list", "--json", env=clean_env(TORCHPATCH_DISABLE="torch-six")).stdout)}
    assert off["torch-six"]["enabled"] is False and off["torch-six"]["enabled_reason"] == "in TORCHPATCH_DISABLE"


def test_list_text():
    out = cli("list").stdout
    assert f"torch {TORCH}" in out and "torch-six" in out and "processgroup-deepcopy" in out


def test_doctor_json():
    report = json.loads(cli("doctor", "--json", env=clean_env(TORCHPATCH="1", TORCHPATCH_DISABLE="nope")).stdout)
    assert report["torch"] == TORCH
    assert any(path.endswith("torchpatch.pth") for path in report["startup_hook"])
    assert report["flags"] == {"TORCHPATCH": "1", "TORCHPATCH_DISABLE": "nope"}
    assert "processgroup-deepcopy" in report["would_apply"]
    assert any("unknown patch id(s) nope" in w for w in report["warnings"])
    assert report["hazards"] == []  # the matrix venvs pin numpy<2 where torch needs it


def test_doctor_names_the_numpy_hazard():
    out = run_py(
        """
        from torchpatch import _cli
        _cli._dist_version = lambda name: {"numpy": "2.1.0"}.get(name)
        print(_cli._hazards("2.1.2+cu121"))
        print(_cli._hazards("2.4.1"))
        """
    ).stdout.splitlines()
    assert "numpy 2.1.0 beside torch 2.1.2+cu121" in out[0] and "numpy<2" in out[0]
    assert out[1] == "[]"


# ``torchpatch doctor`` on each torch version given, faked where doctor (and the plan) read it.
DOCTOR_ON = """
import contextlib, io, json, sys
from torchpatch import _cli, _versions
out = {}
for version in sys.argv[1:]:
    _versions.torch_version = lambda: version
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        _cli.main(["doctor"])
    with contextlib.redirect_stdout(io.StringIO()) as report:
        _cli.main(["doctor", "--json"])
    out[version] = {"lines": [line for line in text.getvalue().splitlines() if line.startswith("warning")],
                    "report": json.loads(report.getvalue())}
print(json.dumps(out))
"""


def test_doctor_warns_on_a_torch_newer_than_the_tested_ones():
    major, minor = _versions.release(NEWEST_TESTED_TORCH)[:2]
    newer, nightly = f"{major}.{minor + 1}.0", f"{major}.{minor + 1}.0a0+git1234567"
    out = run_json(DOCTOR_ON, args=[newer, nightly, NEWEST_TESTED_TORCH, TORCH])
    for version in (newer, nightly):
        report = out[version]["report"]
        assert report["torch"] == version and report["newest_tested_torch"] == NEWEST_TESTED_TORCH
        warning, = [w for w in report["warnings"] if "newer than" in w]
        assert warning.startswith(f"torch {version} is newer than the newest torch this catalogue was tested on "
                                  f"({NEWEST_TESTED_TORCH}): the patches whose version range is open-ended apply untested (")
        assert "processgroup-deepcopy" in warning and "sdpa-backport" not in warning  # >=1.13 applies, <2.3 not
        assert out[version]["lines"] == [f"warning      {warning}"]
    for version in (NEWEST_TESTED_TORCH, TORCH):  # tested: no warning
        assert out[version]["lines"] == [] and out[version]["report"]["warnings"] == []


def test_newest_tested_torch_is_the_newest_of_the_matrix():
    matrix = re.findall(r'^\s*"(\d+\.\d+\.\d+)":', (REPO / "noxfile.py").read_text(), re.M)
    assert max(matrix, key=_versions.release) == NEWEST_TESTED_TORCH


def test_run_activates_and_passes_arguments():
    proc = cli("run", "--", sys.executable, "-c",
               "import sys, torchpatch; print(torchpatch.is_installed(), sys.argv[1:])", "a", "b")
    assert proc.stdout.strip() == "True ['a', 'b']", proc.stderr


def test_run_works_for_a_target_install_and_chains_sitecustomize(tmp_path):
    """``pip install --target`` onto a shared PYTHONPATH, used from a venv that lacks torchpatch:
    no .pth is processed there, so only ``torchpatch run``'s bootstrap can activate it."""
    wheel_dir, target, other, fresh = (tmp_path / n for n in ("wheel", "target", "other", "venv"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheel_dir), str(REPO)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target),
                    *map(str, wheel_dir.glob("*.whl"))], check=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True)
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_CHAINED = True\n")
    python = str(fresh / "bin" / "python")
    probe = ("import builtins, torchpatch; "
             "print(torchpatch.is_installed(), getattr(builtins, 'SITE_CHAINED', False))")
    env = clean_env(PYTHONPATH=f"{target}:{other}")
    plain = subprocess.run([python, "-c", probe], env=dict(env, TORCHPATCH="1"), capture_output=True, text=True)
    assert plain.stdout.split() == ["False", "True"], plain.stderr  # TORCHPATCH=1 alone: no hook here
    proc = subprocess.run([python, str(target / "bin" / "torchpatch"), "run", "--", python, "-c", probe],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["True", "True"], proc.stderr


def test_sitecustomize_example_chains_when_off(tmp_path):
    boot, other = tmp_path / "boot", tmp_path / "other"
    boot.mkdir()
    other.mkdir()
    (boot / "sitecustomize.py").write_text((REPO / "sitecustomize_example.py").read_text())
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_CHAINED = True\n")
    code = ("import builtins, sys; startup = sys.modules.get('_torchpatch_startup'); "
            "print(getattr(builtins, 'SITE_CHAINED', False), bool(startup and startup.pending()))")
    off = run_py(code, env=clean_env(PYTHONPATH=f"{boot}:{other}"))
    on = run_py(code, env=clean_env(PYTHONPATH=f"{boot}:{other}", TORCHPATCH="1"))
    assert off.stdout.split() == ["True", "False"], off.stderr
    assert on.stdout.split() == ["True", "True"], on.stderr

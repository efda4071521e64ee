"""The ``torchpatch`` command: list, doctor, run, --help."""

import json
import subprocess
import sys

from conftest import REPO, TORCH, clean_env, run_py, torch_matches


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

"""The ``torchpatch`` command: list, doctor, run, --help."""

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, TORCH, clean_env, make_plugin, run_json, run_py, torch_matches
from torchpatch import _versions
from torchpatch.patches import NEWEST_TESTED_TORCH

pytestmark = pytest.mark.fresh_interpreter  # the command line's own processes


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "torchpatch", *args], env=env or clean_env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.torch_independent
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


def test_list_says_activation_is_off_and_what_would_be_on():
    off, on = cli("list"), cli("list", env=clean_env(TORCHPATCH="1"))
    first = off.stdout.splitlines()[0]
    assert "activation is OFF here (TORCHPATCH is not set): nothing is applied; with TORCHPATCH=1 the patches would be:" in first
    row = next(line for line in off.stdout.splitlines() if line.strip().startswith("processgroup-deepcopy"))
    assert row.endswith("applies; would be on (on by default)"), row
    assert "; on (" not in off.stdout
    assert "activation is on (TORCHPATCH=1); patches:" in on.stdout.splitlines()[0]
    row = next(line for line in on.stdout.splitlines() if line.strip().startswith("processgroup-deepcopy"))
    assert row.endswith("applies; on (on by default)") and "would be" not in on.stdout
    zero = cli("list", env=clean_env(TORCHPATCH="0", TORCHPATCH_DISABLE="torch-six")).stdout
    assert "activation is OFF here (TORCHPATCH='0')" in zero and "would be off (in TORCHPATCH_DISABLE)" in zero
    assert {r["activated"] for r in json.loads(cli("list", "--json").stdout)} == {False}
    assert {r["activated"] for r in json.loads(cli("list", "--json", env=clean_env(TORCHPATCH="1")).stdout)} == {True}


def test_output_piped_into_a_reader_that_stops_ends_quietly():
    """``torchpatch list | head -1``: the reader goes away; no BrokenPipeError traceback, status 141
    (128 + SIGPIPE) as for the standard tools. The read end is closed before anything is written, so
    every write fails, whatever the size of the pipe's buffer."""
    fixture = str(REPO / "tests" / "fixtures" / "check" / "clean")
    for args in (["list"], ["list", "--json"], ["doctor"], ["check", fixture, "--torch", "2.1.2"], ["--help"]):
        proc = subprocess.Popen([sys.executable, "-m", "torchpatch", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=clean_env(), text=True)
        proc.stdout.close()
        err = proc.stderr.read()
        proc.stderr.close()
        code = proc.wait(timeout=120)
        assert err == "", (args, err)
        assert code == (0 if args == ["--help"] else 141), (args, code)  # argparse's help ignores the failed write


@pytest.mark.torch_independent
def test_a_plugin_with_the_same_patch_in_patch_and_patches_is_not_warned_about(tmp_path):
    """``PATCH = P`` and ``PATCHES = [P]`` in one plugin module: P once, no warning that its id is
    taken; another Patch object reusing the id still is one."""
    make_plugin(tmp_path, "tp_both", "from torchpatch import Patch\n"
                "PATCH = Patch(id='both-ways', summary='s', torch='>=1.0', upstream='u')\n"
                "PATCHES = [PATCH]\n"
                "OTHER = Patch(id='both-ways', summary='another', torch='>=1.0', upstream='u')\n")
    env = clean_env(PYTHONPATH=str(tmp_path))
    proc = cli("list", "--json", env=env)
    assert [r["id"] for r in json.loads(proc.stdout)].count("both-ways") == 1
    assert "already taken" not in proc.stderr, proc.stderr
    (tmp_path / "tp_both.py").write_text((tmp_path / "tp_both.py").read_text() + "PATCHES = [PATCH, OTHER]\n")
    proc = cli("list", "--json", env=env)
    assert [r["id"] for r in json.loads(proc.stdout)].count("both-ways") == 1
    assert "ignoring third-party patch 'both-ways' from entry point tp_both = tp_both: the id is already taken" in proc.stderr


@pytest.mark.torch_independent
def test_flag_values_cannot_forge_lines_of_output():
    env = clean_env(TORCHPATCH="1\n", TORCHPATCH_DISABLE="nope\nforged line")
    assert "activation is on (TORCHPATCH='1\\n'); patches:" in cli("list", env=env).stdout.splitlines()[0]
    doctor = cli("doctor", env=env).stdout
    assert "TORCHPATCH='1\\n' TORCHPATCH_DISABLE='nope\\nforged line'" in doctor
    assert "TORCHPATCH_DISABLE names unknown patch id(s) 'nope\\nforged line'" in doctor
    assert not [line for line in doctor.splitlines() if line.startswith("forged")], doctor


@pytest.mark.torch_independent
@pytest.mark.parametrize("command, module, attribute", [
    (["check", str(REPO / "tests" / "fixtures" / "check" / "clean"), "--torch", "2.1.2"], "torchpatch._check.progress",
     "Progress.say"),
    (["explain", "torch.distributed", "--torch", "2.1.2"], "torchpatch._check.explain", "explain"),
    (["list"], "torchpatch._cli", "plan"),
])
def test_ctrl_c_ends_quietly_with_status_130(command, module, attribute):
    code = f"""
import importlib, signal, sys
from torchpatch._cli import main

def interrupt(*args, **kwargs):
    signal.raise_signal(signal.SIGINT)  # Ctrl-C, in the middle of the command: Python raises KeyboardInterrupt

# as in a terminal: a process started in the background of a non-interactive shell (a CI runner's
# `cmd &`, nohup) inherits SIGINT ignored, and Python then leaves it ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

owner = importlib.import_module({module!r})
*path, name = {attribute!r}.split(".")
for part in path:
    owner = getattr(owner, part)
setattr(owner, name, interrupt)
sys.exit(main({command!r}))
"""
    proc = run_py(code, timeout=120)
    assert (proc.returncode, proc.stderr) == (130, ""), proc.stderr


def test_doctor_json():
    proc = cli("doctor", "--json", env=clean_env(TORCHPATCH="1", TORCHPATCH_DISABLE="nope"))
    report = json.loads(proc.stdout)
    assert report["torch"] == TORCH
    assert any(path.endswith("torchpatch.pth") for path in report["startup_hook"])
    assert report["activation"]["on"] is True and report["activation"]["hook_ran"] is True  # the .pth armed it
    assert report["flags"] == {"TORCHPATCH": "1", "TORCHPATCH_DISABLE": "nope"}
    assert "processgroup-deepcopy" in report["would_apply"]
    assert any("unknown patch id(s) nope" in w for w in report["warnings"])
    assert report["missing_dependencies"] == [] and report["wrapt"] and report["packaging"]
    # the matrix venvs pin numpy<2 where torch needs it; a development overlay (a venv in front of
    # another that has torchpatch too) really has two copies, which test_doctor.py covers
    copies = [h for h in report["hazards"] if "installed copies of torchpatch" in h]
    assert len(copies) == (len(report["copies"]["packages"]) > 1 or len(report["copies"]["distributions"]) > 1)
    assert [h for h in report["hazards"] if h not in copies] == []
    assert proc.returncode == (1 if copies else 0)


def test_doctor_names_the_numpy_hazard():
    out = run_py(
        """
        from torchpatch import _doctor
        _doctor._dist_version = lambda name: {"numpy": "2.1.0"}.get(name)
        print(_doctor._hazards("2.1.2+cu121"))
        print(_doctor._hazards("2.4.1"))
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


@pytest.mark.torch_independent
def test_version_is_the_packages():
    import torchpatch

    assert cli("--version").stdout.strip() == f"torchpatch {torchpatch.__version__}"


@pytest.mark.torch_independent
def test_run_warns_where_the_interpreter_flags_defeat_its_bootstrap():
    probe = "import torchpatch; print(torchpatch.is_installed())"
    plain = cli("run", "--", sys.executable, "-c", probe)
    assert plain.stdout.strip() == "True" and plain.stderr == ""
    no_site = cli("run", "--", sys.executable, "-S", "-c", "import sys; print('torchpatch' in sys.modules)")
    assert no_site.stdout.strip() == "False"  # nothing ran: the warning is true
    assert no_site.stderr.startswith("torchpatch run: warning: python -S skips the site module, so neither")
    assert "torchpatch stays off in that process" in no_site.stderr
    # -I and -E ignore PYTHONPATH (the bootstrap); this interpreter's own .pth still activates it
    for flag in ("-I", "-E", "-uE"):
        proc = cli("run", "--", sys.executable, flag, "-c", probe)
        assert proc.stdout.strip() == "True", proc.stderr
        assert "ignores PYTHONPATH, so this command's bootstrap does not reach it" in proc.stderr, flag
        assert "(this interpreter has one)" in proc.stderr
    quiet = cli("run", "--", sys.executable, "-S", "-c", "pass", env=clean_env(TORCHPATCH_LOG="off"))
    assert quiet.stderr == ""


@pytest.mark.torch_independent
def test_interpreter_flags_of_a_command():
    from torchpatch._run import interpreter_flags

    assert interpreter_flags(["python3", "-u", "-X", "dev", "-SE", "train.py", "-I"]) == {"u", "S", "E"}
    assert interpreter_flags(["/usr/bin/python3.11", "-W", "error", "-I", "-m", "torch.distributed.run"]) == {"I"}
    assert interpreter_flags(["python", "-Xdev", "-IS", "x.py"]) == {"I", "S"}
    assert interpreter_flags(["python", "-c", "-S"]) == set() and interpreter_flags(["python", "-mS"]) == set()
    assert interpreter_flags(["python", "--check-hash-based-pycs", "always", "-E", "x.py"]) == {"E"}
    assert interpreter_flags(["torchrun", "-S", "train.py"]) == set()  # not an interpreter by name


@pytest.mark.torch_independent
def test_run_activates_and_passes_arguments():
    proc = cli("run", "--", sys.executable, "-c",
               "import sys, torchpatch; print(torchpatch.is_installed(), sys.argv[1:])", "a", "b")
    assert proc.stdout.strip() == "True ['a', 'b']", proc.stderr


@pytest.mark.torch_independent
def test_run_works_for_a_target_install_and_chains_sitecustomize(tmp_path, wheel):
    """``pip install --target`` onto a shared PYTHONPATH, used from a venv that lacks torchpatch:
    no .pth is processed there, so only ``torchpatch run``'s bootstrap can activate it."""
    target, other, fresh = (tmp_path / n for n in ("target", "other", "venv"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(target), str(wheel)], check=True)
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


@pytest.mark.torch_independent
def test_bootstrap_sitecustomize_chains_when_off(tmp_path):
    boot, other = tmp_path / "boot", tmp_path / "other"
    boot.mkdir()
    other.mkdir()
    (boot / "sitecustomize.py").write_text((REPO / "src" / "torchpatch" / "_bootstrap" / "sitecustomize.py").read_text())
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_CHAINED = True\n")
    code = ("import builtins, sys; startup = sys.modules.get('_torchpatch_startup'); "
            "print(getattr(builtins, 'SITE_CHAINED', False), bool(startup and startup.pending()))")
    off = run_py(code, env=clean_env(PYTHONPATH=f"{boot}:{other}"))
    on = run_py(code, env=clean_env(PYTHONPATH=f"{boot}:{other}", TORCHPATCH="1"))
    assert off.stdout.split() == ["True", "False"], off.stderr
    assert on.stdout.split() == ["True", "True"], on.stderr

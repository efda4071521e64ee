"""``TORCHPATCH_REPORT=DIR``: one JSON file per process that activated torchpatch, written at
activation, when a patch settles, and at exit."""

import json
import os
import re
import socket
import stat

import pytest

from conftest import ARM, TORCH, clean_env, plugin_env, run_json, run_py, run_ranks

# each process's report, from activation to its last write at exit; process plumbing (conftest.PLUMBING_MINORS)
pytestmark = [pytest.mark.fresh_interpreter, pytest.mark.plumbing]
# Where what is tested is the report's file (its directory, mode, command line), the process activates
# torchpatch by looking torch up (ARM) instead of importing it: the same activation, without torch's import.
from torchpatch import _report

# Each rank uses one served symbol of the demo plugin (tp_target.Served) and never touches another
# (tp_target.NEEDS_OLD), imports the module whose patch fails (demo-broken), and rank 0 reads a batch
# through a DataLoader worker started with "spawn": a fresh interpreter that activates by itself.
JOB = """
import os
import torch, tp_target


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor(i)


if __name__ == "__main__":
    assert tp_target.Served.origin == "torchpatch"
    import tp_target.broken_target
    if os.environ["RANK"] == "0":
        batches = list(torch.utils.data.DataLoader(Items(), num_workers=1, multiprocessing_context="spawn"))
        assert len(batches) == 2
"""
FIELDS = {"torchpatch", "host", "pid", "parent_pid", "rank", "local_rank", "world_size", "argv", "executable",
          "python", "torch", "activated", "written", "complete", "flags", "patches", "switched_off", "used"}


def reports(directory):
    return {path.name: json.loads(path.read_text()) for path in directory.iterdir()}


def test_one_report_per_process_of_a_torchrun_job(tmp_path):
    out = tmp_path / "reports" / "job"  # made by the processes
    proc = run_ranks(JOB, tmp_path=tmp_path, launcher="torchrun",
                     env=plugin_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(out), TORCHPATCH_DISABLE="demo-shim"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = reports(out)  # valid JSON only: no temporary file is left behind
    assert len(found) == 4, sorted(found)  # torchrun's agent, 2 ranks, rank 0's DataLoader worker
    (agent,) = [r for r in found.values() if r["rank"] is None]
    rank0, rank1 = sorted((r for r in found.values() if r["parent_pid"] == agent["pid"]), key=lambda r: r["rank"])
    (worker,) = [r for r in found.values() if r["parent_pid"] == rank0["pid"]]
    host = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())
    for name, report in found.items():
        assert set(report) == FIELDS
        rank = "none" if report["rank"] is None else report["rank"]
        assert name == f"torchpatch-{host}-{rank}-{report['pid']}.json"
        assert report["torch"] == TORCH and report["python"].startswith("3.") and report["torchpatch"] == "0.1.0"
        assert report["flags"]["TORCHPATCH_REPORT"] == str(out)
        assert report["switched_off"] == {"demo-shim": "in TORCHPATCH_DISABLE"}
        assert report["complete"] is True  # written at exit
        assert "demo-shim" not in report["patches"]
    assert (agent["local_rank"], agent["world_size"]) == (None, None)
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in (rank0, rank1, worker)] == [(0, 0, 2), (1, 1, 2), (0, 0, 2)]
    assert rank0["argv"][0].endswith("rank_script.py")
    for rank in (rank0, rank1):
        assert rank["patches"]["demo-broken"] == {
            "status": "failed", "error": "while applying to tp_target.broken_target: RuntimeError: demo patch is broken"}
        assert rank["used"]["symbols"] == {"tp_target.Served": {"patch": "demo-symbol"}}  # not tp_target.NEEDS_OLD
    # The agent never imports tp_target; the worker imports it (spawn runs the script's top again) but
    # neither uses tp_target.Served nor imports tp_target.broken_target.
    assert agent["patches"]["demo-symbol"] == agent["patches"]["demo-broken"] == {"status": "waiting for its module"}
    assert worker["patches"]["demo-symbol"] == {"status": "applied"}
    assert worker["patches"]["demo-broken"] == {"status": "waiting for its module"}
    assert agent["used"] == worker["used"] == {"modules": {}, "symbols": {}}


def test_served_modules_and_aliases_used(tmp_path):
    code = "import importlib.util; importlib.util.find_spec('torch')\nimport tp_target.moved, tp_target.pkg_moved.sub\n"
    proc = run_py(code, env=plugin_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    (report,) = reports(tmp_path).values()
    assert report["used"]["modules"] == {
        "tp_target.moved": {"patch": "demo-shim", "alias_of": "tp_target.existing"},
        "tp_target.pkg_moved": {"patch": "demo-shim", "alias_of": "tp_target.pkg"},
        "tp_target.pkg_moved.sub": {"patch": "demo-shim", "alias_of": "tp_target.pkg.sub"},
    }  # not tp_target.missing, which the process never imported
    assert report["used"]["symbols"] == {} and report["rank"] is None


def test_a_process_that_never_reaches_exit_leaves_its_report(tmp_path):
    # os._exit skips atexit, as a signal or Ray's ray.kill does; RANK set after activation (as Ray
    # Train's worker setup does) renames the one file
    code = """
import os, torch, tp_target
assert tp_target.Served.origin == "torchpatch"
os.environ["RANK"] = "3"
try:
    import tp_target.broken_target
finally:
    os._exit(0)
"""
    proc = run_py(code, env=plugin_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    ((name, report),) = reports(tmp_path).items()
    assert name.endswith(f"-3-{report['pid']}.json") and report["rank"] == 3
    assert report["complete"] is False
    assert report["patches"]["demo-symbol"] == {"status": "applied"}
    assert report["patches"]["demo-broken"]["status"] == "failed"
    assert report["used"]["symbols"] == {"tp_target.Served": {"patch": "demo-symbol"}}


def test_an_unwritable_directory_is_one_warning_and_never_an_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for strict in ("0", "1"):
        proc = run_py(ARM, env=clean_env(TORCHPATCH="1", TORCHPATCH_STRICT=strict,
                                                     TORCHPATCH_REPORT=str(blocker / "reports")))
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if "TORCHPATCH_REPORT" in line]
        assert len(warnings) == 1, proc.stderr
        assert f"cannot write this process's report into {blocker / 'reports'}" in warnings[0]
        assert "point TORCHPATCH_REPORT at a writable directory, or unset it" in warnings[0]


def test_a_report_is_its_owners_alone_whatever_the_umask(tmp_path):
    out = tmp_path / "made"
    proc = run_py("import os; os.umask(0)\n" + ARM, env=clean_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(out)))
    assert proc.returncode == 0, proc.stderr
    (path,) = out.iterdir()
    assert (stat.S_IMODE(out.stat().st_mode), stat.S_IMODE(path.stat().st_mode)) == (0o700, 0o600)


@pytest.mark.torch_independent
def test_the_writer_follows_no_link_and_sets_the_mode_on_its_descriptor(tmp_path, monkeypatch):
    """Another user who swaps the temporary file for a link to a file of this user's, between its
    creation and the rest (the race of a mode set by name), changes nothing of that file."""
    victim = tmp_path / "victim"
    victim.write_text("private")
    victim.chmod(0o600)
    folder = tmp_path / "reports"
    real_open = os.open

    def open_then_swap(path, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        if flags & os.O_EXCL:  # the temporary file, moved away and a link put in its place
            os.rename(path, "moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(victim, path, dir_fd=dir_fd)
        return fd

    monkeypatch.setattr(os, "open", open_then_swap)
    monkeypatch.setattr(os, "chmod", lambda *args, **kwargs: pytest.fail("a mode set through a name"))
    umask = os.umask(0)
    try:
        _report.write(str(folder), {"host": "h", "rank": None, "pid": 1})
    finally:
        os.umask(umask)
    assert victim.read_text() == "private" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    written = folder / "moved"  # what the writer wrote, through its descriptor: its owner's alone
    assert json.loads(written.read_text()) == {"host": "h", "rank": None, "pid": 1}
    assert stat.S_IMODE(written.stat().st_mode) == 0o600


@pytest.mark.torch_independent
@pytest.mark.parametrize("owner, mode, refused", [
    (1000, 0o700, None),
    (1000, 0o755, None),
    (0, 0o1777, None),  # /tmp: root's, with the sticky bit
    (1000, 0o1770, None),  # a group's folder with the sticky bit: nobody replaces another's files
    (1001, 0o700, "it belongs to another user (uid 1001)"),
    (1001, 0o1777, "it belongs to another user (uid 1001)"),
    (1000, 0o777, "others can write into it (mode 777, no sticky bit)"),
    (1000, 0o2770, "others can write into it (mode 2770, no sticky bit)"),
    (0, 0o777, "others can write into it (mode 777, no sticky bit)"),
])
def test_which_folders_a_report_goes_into(owner, mode, refused):
    folder = os.stat_result((stat.S_IFDIR | mode, 0, 0, 2, owner, 0, 0, 0, 0, 0))
    if refused is None:
        _report.check_folder(folder, 1000)
    else:
        with pytest.raises(_report.UnsafeFolder, match=re.escape(refused)):
            _report.check_folder(folder, 1000)


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_folder_others_can_write_is_one_warning_and_no_report(tmp_path, strict):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = clean_env(TORCHPATCH="1", TORCHPATCH_STRICT=strict, TORCHPATCH_REPORT=str(shared))
    proc = run_py(ARM, env=env)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "TORCHPATCH_REPORT" in line]
    assert len(warnings) == 1, proc.stderr
    assert (f"not writing this process's report into {shared} (TORCHPATCH_REPORT): others can write into it (mode"
            " 777, no sticky bit), so another user could replace or read it; point TORCHPATCH_REPORT at a directory"
            " of yours that only you can write (or one with the sticky bit, chmod +t), or unset it") in warnings[0]
    assert list(shared.iterdir()) == []
    shared.chmod(0o1777)  # as /tmp: others may write into it, but not replace this user's files
    assert "TORCHPATCH_REPORT" not in run_py(ARM, env=env).stderr and len(list(shared.iterdir())) == 1


@pytest.mark.parametrize("value, argv, warned", [(None, ["-c", "--token=SECRET"], False), ("1", ["-c", "--token=SECRET"], False),
                                                 ("0", None, False), ("maybe", None, True)])
def test_the_command_line_is_in_the_report_unless_left_out(tmp_path, value, argv, warned):
    env = clean_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path), TORCHPATCH_REPORT_ARGV=value)
    proc = run_py(ARM, args=["--token=SECRET"], env=env)
    assert proc.returncode == 0, proc.stderr
    (report,) = reports(tmp_path).values()
    assert report["argv"] == argv
    assert ("ignoring TORCHPATCH_REPORT_ARGV='maybe'" in proc.stderr) is warned, proc.stderr


def test_a_relative_directory_is_taken_at_activation(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    proc = run_py(ARM + "import os; os.chdir('elsewhere')", env=clean_env(TORCHPATCH="1", TORCHPATCH_REPORT="out"),
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "out").iterdir())) == 1 and not (tmp_path / "elsewhere" / "out").exists()


def test_nothing_without_torchpatch_and_no_report_module_without_the_variable(tmp_path):
    code = "import json, sys, torch; print(json.dumps(sorted(m for m in sys.modules if 'torchpatch' in m)))"
    assert run_json(code, env=clean_env(TORCHPATCH_REPORT=str(tmp_path))) == []
    assert list(tmp_path.iterdir()) == []
    # with torchpatch on, activation alone decides: torch looked up, not imported (2-5 s of CPU a process)
    armed = ARM + code.replace(", torch;", ";")
    assert "torchpatch._report" not in run_json(armed, env=clean_env(TORCHPATCH="1"))
    assert "torchpatch._report" in run_json(armed, env=clean_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path)))


def test_help_names_the_variable():
    out = run_py("from torchpatch._cli import main; main(['--help'])").stdout
    assert "TORCHPATCH_REPORT=DIR" in out and "DIR/torchpatch-<host>-<rank>-<pid>.json" in out
    assert "TORCHPATCH_REPORT_ARGV=0" in out

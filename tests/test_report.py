"""``TORCHPATCH_REPORT=DIR``: one JSON file per process that activated torchpatch, written at
activation, when a patch settles, and at exit."""

import json
import re
import socket

from conftest import TORCH, clean_env, plugin_env, run_json, run_py, run_ranks

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
        proc = run_py("import torch", env=clean_env(TORCHPATCH="1", TORCHPATCH_STRICT=strict,
                                                     TORCHPATCH_REPORT=str(blocker / "reports")))
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if "TORCHPATCH_REPORT" in line]
        assert len(warnings) == 1, proc.stderr
        assert f"cannot write this process's report into {blocker / 'reports'}" in warnings[0]
        assert "point TORCHPATCH_REPORT at a writable directory, or unset it" in warnings[0]


def test_a_relative_directory_is_taken_at_activation(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    proc = run_py("import os, torch; os.chdir('elsewhere')", env=clean_env(TORCHPATCH="1", TORCHPATCH_REPORT="out"),
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert len(list((tmp_path / "out").iterdir())) == 1 and not (tmp_path / "elsewhere" / "out").exists()


def test_nothing_without_torchpatch_and_no_report_module_without_the_variable(tmp_path):
    code = "import json, sys, torch; print(json.dumps(sorted(m for m in sys.modules if 'torchpatch' in m)))"
    assert run_json(code, env=clean_env(TORCHPATCH_REPORT=str(tmp_path))) == []
    assert list(tmp_path.iterdir()) == []
    assert "torchpatch._report" not in run_json(code, env=clean_env(TORCHPATCH="1"))
    assert "torchpatch._report" in run_json(code, env=clean_env(TORCHPATCH="1", TORCHPATCH_REPORT=str(tmp_path)))


def test_help_names_the_variable():
    out = run_py("from torchpatch._cli import main; main(['--help'])").stdout
    assert "TORCHPATCH_REPORT=DIR" in out and "DIR/torchpatch-<host>-<rank>-<pid>.json" in out

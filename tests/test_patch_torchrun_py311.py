"""torchrun-py311: torch 1.13's torchrun on Python 3.11 -- the launcher itself patched by the
start-up hook, 2 ranks that all_reduce, and --redirects/--tee parsed as torch 2.x parses them."""

import json
import re
import subprocess
import sys

import pytest

from conftest import RESULT, clean_env, free_port, run_json, where_patch_applies, where_patch_does_not_apply

pytestmark = [pytest.mark.skipif(sys.version_info < (3, 11), reason="the bug is Python 3.11's IntFlag iteration"), pytest.mark.fresh_interpreter]  # torchrun's own start

# Std.from_str for every form torchrun accepts, next to the member each must give (Std(int(v)),
# which is how torch >= 2.0 looks them up); and the error for what it must refuse.
TABLE = """
import json, torchpatch
from torch.distributed.elastic.multiprocessing.api import Std

def show(x):
    if isinstance(x, dict):
        return {str(k): show(v) for k, v in x.items()}
    return None if x is None else [type(x).__name__, x.name, int(x)]

inputs = ["0", "1", "2", "3", "0:1,1:2", "0:3,1:0,2:1,3:2", "1:3"]
expected = {"0": Std(0), "1": Std(1), "2": Std(2), "3": Std(3), "0:1,1:2": {0: Std(1), 1: Std(2)},
            "0:3,1:0,2:1,3:2": {0: Std(3), 1: Std(0), 2: Std(1), 3: Std(2)}, "1:3": {1: Std(3)}}
errors = {}
for bad in ("4", "0:4", "a", "0:1;1:2"):
    try:
        Std.from_str(bad)
    except ValueError as exc:
        errors[bad] = str(exc)
func = Std.from_str.__func__
print(json.dumps({
    "got": {x: show(Std.from_str(x)) for x in inputs},
    "expected": {x: show(v) for x, v in expected.items()},
    "identity": [Std.from_str("0") is Std.NONE, Std.from_str("3") is Std.ALL],
    "errors": errors,
    "doc": (func.__doc__ or "").strip().splitlines()[0] if func.__doc__ else None,
    "native": type(vars(Std)["from_str"]) is classmethod and func.__module__ == Std.__module__
              and func.__code__.co_filename.endswith("api.py"),
    "status": torchpatch.status().get("torchrun-py311"),
}))
"""

WORKER = """
import json, os, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.arange(3, dtype=torch.float64) + rank * 10
dist.all_reduce(t)
print(RESULT + json.dumps({"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
                           "sum": t.tolist()}), flush=True)
dist.destroy_process_group()
""".replace("RESULT", repr(RESULT))


def torchrun(tmp_path, *args, env):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *args, str(script)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def results(stdout):
    """rank -> (what precedes the result on its line: the tee prefix, result). Ranks share the
    launcher's stdout, so results are found wherever they start, not only at line starts."""
    found = {}
    at = stdout.find(RESULT)
    while at >= 0:
        out, end = json.JSONDecoder().raw_decode(stdout, at + len(RESULT))
        found[out["rank"]] = (stdout[stdout.rfind("\n", 0, at) + 1:at], out)
        at = stdout.find(RESULT, end)
    return found


def check_table(out):
    assert out["got"] == out["expected"]
    assert out["identity"] == [True, True]
    assert out["errors"] == {bad: f"{bad} does not match: <^[0123]$> or <^(\\d:[0123],)*(\\d:[0123])$>"
                             for bad in ("4", "0:4", "a", "0:1;1:2")}
    assert out["doc"] == "Example:"


@where_patch_applies("torchrun-py311", "torch 2.0 has the fix")
def test_native_torchrun_dies(tmp_path):
    proc = torchrun(tmp_path, env=clean_env())
    assert proc.returncode != 0
    assert "AttributeError: 'NoneType' object has no attribute 'get'" in proc.stderr
    assert results(proc.stdout) == {}
    out = run_json(TABLE)  # the cause: "0" and "3" (NONE, ALL) are not found
    assert out["got"]["0"] is None and out["got"]["3"] is None and out["got"]["1:3"] == {"1": None}
    assert out["native"] is True


@where_patch_applies("torchrun-py311", "torch 2.0 has the fix")
def test_from_str_fixed():
    out = run_json(TABLE, env=clean_env(TORCHPATCH="1"))
    check_table(out)
    assert out["native"] is False and out["status"] == "applied"


@where_patch_applies("torchrun-py311", "torch 2.0 has the fix")
def test_torchrun_runs_two_ranks_with_tee_mapping(tmp_path):
    # --tee 0:3 exercises the mapping form (rank 0 teed with a prefix, rank 1 not); --redirects
    # keeps its default "0", the value form that crashed.
    proc = torchrun(tmp_path, "--tee", "0:3", env=clean_env(TORCHPATCH="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = results(proc.stdout)
    expect = [sum(float(i + r * 10) for r in range(2)) for i in range(3)]
    assert {r: out for r, (_prefix, out) in found.items()} == {
        r: {"rank": r, "world": 2, "local_rank": r, "sum": expect} for r in range(2)
    }
    assert re.search(r"\[\w+0\]:$", found[0][0]) and not re.search(r"\[\w+1\]:", found[1][0])


@where_patch_does_not_apply("torchrun-py311", "where torch has the fix, Std.from_str stays torch's")
def test_inactive_where_torch_is_fixed():
    out = run_json(TABLE, env=clean_env(TORCHPATCH="1"))
    check_table(out)  # torch's own fixed parser: the reference the patched 1.13 one must match
    assert out["native"] is True and out["status"] is None

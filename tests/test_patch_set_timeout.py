"""set-timeout: ``torch.distributed.set_timeout(timeout, group)`` on torch 2.9-2.13; set-timeout-gloo-24 on
2.4, whose ``_set_pg_timeout`` does not reach gloo's collectives (served with torch 2.14's warning for a
backend that keeps its timeout; the lone all_reduce below is not run there: it would wait the 60 s). 2 gloo ranks made
with a 60 s timeout; the script shortens it to 2 s on the default group and on a subgroup, then rank 0
enters an all_reduce that rank 1 never joins (rank 1 waits on the store until rank 0 is done). Natively
before 2.14 the call is an ``AttributeError``. With torchpatch it is served, and the lone all_reduce
fails with gloo's timeout after about 2 s, not 60: as torch >= 2.14's own ``set_timeout`` does (the
reference, where the patch stays out of the way)."""

from conftest import RESULT, clean_env, only_torch, ranks_result, until_patch_range_ends, where_patch_applies

SCRIPT = """
import datetime, json, os, time, warnings, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
store = dist.distributed_c10d._get_default_store()
sub = dist.new_group([0, 1])
out = {}
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for group in (None, sub):
            dist.set_timeout(datetime.timedelta(seconds=2), group)
    out["warnings"] = [str(w.message) for w in caught if "set_timeout" in str(w.message)]
    out["served_as"] = dist.set_timeout.__module__ + "." + dist.set_timeout.__name__
    out["c10d_same"] = dist.distributed_c10d.set_timeout is dist.set_timeout
except AttributeError as exc:
    out["error"] = f"AttributeError: {exc}"
if "error" not in out and rank == 0 and not out["warnings"]:  # rank 1 never joins these: each must give up after the group's timeout
    for name, group in (("default", None), ("subgroup", sub)):
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            out[name] = "completed"
        except RuntimeError as exc:
            out[name] = {"seconds": time.monotonic() - start, "error": str(exc)[:200]}
# Leave together, on every path (the groups may have timed out: the store, not a barrier). Rank 0 holds
# the store: it stays till rank 1 is done with it, the subgroup's setup included (where set_timeout is
# missing, rank 0 used to leave at once, and rank 1's new_group could lose the store: "Connection reset").
if rank == 0:
    store.set("done", "1")
    store.wait(["seen"], datetime.timedelta(seconds=120))
else:
    store.wait(["done"], datetime.timedelta(seconds=120))
    store.set("seen", "1")
try:
    import torchpatch
    out["status"] = torchpatch.status().get("set-timeout")
except ImportError:
    out["status"] = None
if rank == 0:
    print(RESULT + json.dumps(out), flush=True)
os._exit(0)  # the pairs timed out: leave without the process group's teardown
""".replace("RESULT", repr(RESULT))


def run(tmp_path, **env):
    return ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(**env), timeout=180)


@until_patch_range_ends("set-timeout", since="2.4")
def test_native_has_no_set_timeout(tmp_path):
    out = run(tmp_path)
    assert out["error"] == "AttributeError: module 'torch.distributed' has no attribute 'set_timeout'", out


@where_patch_applies("set-timeout-gloo-24", "2.4's _set_pg_timeout does not reach gloo's collectives")
def test_served_with_a_warning_where_gloo_keeps_its_timeout(tmp_path):
    out = run(tmp_path, TORCHPATCH="1")
    assert out["served_as"] == "torch.distributed.distributed_c10d.set_timeout", out
    assert out["c10d_same"] is True and len(out["warnings"]) == 2, out
    assert all("gloo backend keeps the timeout" in w for w in out["warnings"]), out


def check_timeouts(out):
    for name in ("default", "subgroup"):
        assert isinstance(out[name], dict), out
        assert "Timed out" in out[name]["error"], out
        assert 1.5 <= out[name]["seconds"] < 30, out  # the new 2 s, not the 60 s the groups were made with


@where_patch_applies("set-timeout")
def test_served_set_timeout_shortens_the_groups_timeout(tmp_path):
    out = run(tmp_path, TORCHPATCH="1")
    assert out["status"] == "applied" and out["served_as"] == "torch.distributed.distributed_c10d._set_pg_timeout", out
    assert out["c10d_same"] is True, out
    check_timeouts(out)


@only_torch(">=2.14", "the reference: torch's own set_timeout")
def test_inactive_and_native_semantics(tmp_path):
    out = run(tmp_path, TORCHPATCH="1")
    assert out["status"] is None and out["served_as"] == "torch.distributed.distributed_c10d.set_timeout", out
    assert out["c10d_same"] is True, out
    check_timeouts(out)

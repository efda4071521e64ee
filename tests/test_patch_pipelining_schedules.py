"""pipelining-schedules: ``get_schedule_class`` served on torch 2.4, and the class it returns runs a
real 2-rank, 2-stage GPipe step equal to the same computation on one process."""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_json, run_py, run_ranks,
    where_patch_does_not_apply
)

IMPORT = "from torch.distributed.pipelining.schedules import get_schedule_class"

LOOKUP = """
import json, torch, torchpatch
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.schedules import get_schedule_class

def outcome(name):
    try:
        return get_schedule_class(name).__name__
    except ValueError as exc:
        return "ValueError: " + str(exc)

names = ["gpipe", "GPipe", "GPIPE", "1f1b", "1F1B", "interleaved1f1b", "LoopedBFS", "loopedbfs",
         "PipelineScheduleSingle", "pipelineschedulemulti", "InterleavedZeroBubble", "ZBVZeroBubble",
         "zbvzerobubble", "DualPipeV", "nope", "interleaved_1f1b", ""]
print(json.dumps({
    "outcomes": {n: outcome(n) for n in names},
    "gpipe_is_class": get_schedule_class("gpipe") is schedules.ScheduleGPipe,
    "1f1b_is_class": get_schedule_class("1f1b") is schedules.Schedule1F1B,
    "multi_is_class": get_schedule_class("Interleaved1F1B") is schedules.ScheduleInterleaved1F1B,
    "module": get_schedule_class.__module__,
    "status": torchpatch.status().get("pipelining-schedules"),
}))
"""


@only_torch(">=2.4,<2.5", "torch 2.4 has pipelining without get_schedule_class")
def test_native_import_error():
    proc = run_py(IMPORT)
    assert "ImportError: cannot import name 'get_schedule_class'" in proc.stderr, proc.stderr[-2000:]


@only_torch(">=2.4,<2.5")
def test_lookup_by_name():
    out = run_json(LOOKUP, env=clean_env(TORCHPATCH="1"))
    o = out["outcomes"]
    assert out["gpipe_is_class"] and out["1f1b_is_class"] and out["multi_is_class"]
    assert out["module"] == "torchpatch.patches.pipelining.pipelining_schedules" and out["status"] == "applied"
    assert o["gpipe"] == o["GPipe"] == o["GPIPE"] == "ScheduleGPipe"
    assert o["1f1b"] == o["1F1B"] == "Schedule1F1B"
    assert o["interleaved1f1b"] == "ScheduleInterleaved1F1B"
    assert o["LoopedBFS"] == o["loopedbfs"] == "ScheduleLoopedBFS"
    assert o["PipelineScheduleSingle"] == "PipelineScheduleSingle"
    assert o["pipelineschedulemulti"] == "PipelineScheduleMulti"
    valid = ("['1F1B', 'Interleaved1F1B', 'GPipe', 'LoopedBFS', 'InterleavedZeroBubble', "
             "'PipelineScheduleSingle', 'PipelineScheduleMulti', 'ZBVZeroBubble', 'DualPipeV']")
    for bad in ("nope", "interleaved_1f1b", ""):
        assert o[bad] == f"ValueError: Unknown schedule name '{bad}'. The valid options are {valid}"
    # ZBVZeroBubble (torch 2.6), InterleavedZeroBubble (2.5) and DualPipeV (2.9) are served on 2.4 by
    # pipelining-zbv, pipelining-interleaved-zb and pipelining-dualpipev.
    assert o["ZBVZeroBubble"] == o["zbvzerobubble"] == "ScheduleZBVZeroBubble"
    assert o["InterleavedZeroBubble"] == "ScheduleInterleavedZeroBubble"
    assert o["DualPipeV"] == "ScheduleDualPipeV"


@only_torch(">=2.5", "the reference: torch's own get_schedule_class")
def test_inactive_and_same_semantics_as_native():
    out = run_json(
        """
        import json, torch, torchpatch
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.schedules import get_schedule_class as native
        from torchpatch.patches.pipelining.pipelining_schedules import SCHEDULE_NAMES, make_get_schedule_class
        shim = make_get_schedule_class(schedules, torch.__version__)

        def outcome(fn, name):
            try:
                return fn(name)
            except ValueError as exc:
                return "ValueError: " + str(exc)

        # "nope" compares the error, whose text lists native's valid names.
        names = list(SCHEDULE_NAMES) + ["1f1b", "GPIPE", "zbvzerobubble", "nope", "FlexibleInterleaved1F1B", ""]
        same = {n: outcome(native, n) == outcome(shim, n) for n in names}
        print(json.dumps({"same": same, "file": native.__code__.co_filename,
                          "status": torchpatch.status().get("pipelining-schedules")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["file"].endswith("torch/distributed/pipelining/schedules.py")
    assert out["status"] == "not needed"
    assert all(out["same"].values()), out["same"]
    assert {"GPipe", "DualPipeV", "nope"} <= set(out["same"])


@where_patch_does_not_apply("pipelining-schedules", "no torch.distributed.pipelining at all: this patch serves nothing")
def test_not_served_without_pipelining():
    out = run_json(
        """
        import json, torch, torchpatch
        try:
            import torch.distributed.pipelining.schedules
            error = None
        except ModuleNotFoundError as exc:
            error = str(exc)
        print(json.dumps({"error": error, "status": torchpatch.status().get("pipelining-schedules")}))
        """,
        env=clean_env(TORCHPATCH="1", TORCHPATCH_ENABLE="pipelining-schedules"),
    )
    assert out["error"] is not None and "torch.distributed.pipelining" in out["error"]
    assert out["status"] is None


# Two ranks, one stage each, a schedule class looked up by name; every rank also computes the whole
# model on its own (same seed, same microbatches, one backward per microbatch like the pipeline, then
# divided by their number where the schedule averages them, scale_grads).
GPIPE = """
import copy, datetime, inspect, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
torch.manual_seed(0)
full = nn.Sequential(nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 3), nn.Tanh()))
x, y = torch.randn(8, 6), torch.randn(8, 3)
n_mb = 2
loss_fn = nn.MSELoss()

ref = copy.deepcopy(full)
ref_losses = []
for xm, ym in zip(x.chunk(n_mb), y.chunk(n_mb)):
    loss = loss_fn(ref(xm), ym)
    loss.backward()
    ref_losses.append(loss.item())
if "scale_grads" in inspect.signature(get_schedule_class("gpipe")).parameters:  # the mean (pipelining-scale-grads)
    for p in ref.parameters():
        p.grad.div_(n_mb)

part = copy.deepcopy(full[rank])
example = x.chunk(n_mb)[0] if rank == 0 else torch.zeros(4, 8)
stage = PipelineStage(part, rank, 2, torch.device("cpu"), input_args=example)
schedule = get_schedule_class("gpipe")(stage, n_microbatches=n_mb, loss_fn=loss_fn)
losses = []
if rank == 0:
    schedule.step(x)
else:
    schedule.step(target=y, losses=losses)
grads = [(p.grad, q.grad) for p, q in zip(part.parameters(), ref[rank].parameters())]
mine = {
    "schedule": type(schedule).__name__,
    "grads_equal": all(torch.equal(a, b) for a, b in grads),
    "nonzero": all(a.abs().sum().item() > 0 for a, _ in grads),
    "losses": [l.item() for l in losses], "ref_losses": ref_losses,
}
gathered = [None, None]
dist.all_gather_object(gathered, mine)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@only_torch(">=2.4,<2.5")
def test_gpipe_from_lookup_matches_one_process(tmp_path):
    proc = run_ranks(GPIPE, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, last = rank_result(proc)
    for r in (first, last):
        assert r["schedule"] == "ScheduleGPipe"
        assert r["grads_equal"] and r["nonzero"], r
    assert first["losses"] == [] and len(last["losses"]) == 2
    assert last["losses"] == last["ref_losses"]

"""pipelining-zbv: ScheduleZBVZeroBubble and _PipelineScheduleRuntime on torch 2.4, built on its own
PipelineStage and PipelineScheduleMulti; ScheduleZBVZeroBubble on torch 2.5, on the same runtime (a
subclass of 2.5's own _PipelineScheduleRuntime, with 2.5's split input/weight backward). On 2 real ranks
(V placement: rank 0 holds stages 0 and 3), outputs, per-microbatch losses and every stage's gradients
equal the same model on one process; the ZB-V order equals torch 2.13's own; from torch 2.6 on the patch
stays out of the way. torch 2.5 is not in CI's matrix: tested on 2.5.1 by hand at 7c8f71b, not in CI."""

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_json, run_py, run_ranks,
    where_patch_applies
)

@where_patch_applies("pipelining-zbv", "torch 2.4 has pipelining without these, 2.5 without the schedule")
def test_native_import_error():
    proc = run_py("from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble")
    assert "ImportError: cannot import name 'ScheduleZBVZeroBubble'" in proc.stderr, proc.stderr[-2000:]


@only_torch(">=2.4,<2.5", "torch 2.5 added _PipelineScheduleRuntime")
def test_native_import_error_runtime():
    proc = run_py("from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime")
    assert "ImportError: cannot import name '_PipelineScheduleRuntime'" in proc.stderr, proc.stderr[-2000:]


# Every rank builds the same 4-stage model (float64, Linear + tanh) and computes it on one process
# first, microbatch by microbatch; then the pipeline runs two steps (zero grad between).
RANKS = """
import copy, csv, datetime, json, os, sys, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (PipelineScheduleMulti, ScheduleZBVZeroBubble,
                                                    _PipelineScheduleRuntime, get_schedule_class)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)
S, D, BATCH, N_MB = 2 * W, 8, 16, 4
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(S))
x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
loss_fn = nn.MSELoss()

ref = copy.deepcopy(blocks)
ref_losses, ref_outs = [], []
for xm, ym in zip(x.tensor_split(N_MB), y.tensor_split(N_MB)):
    out = xm
    for b in ref:
        out = b(out)
    loss = loss_fn(out, ym)
    loss.backward()
    ref_losses.append(loss.item())
    ref_outs.append(out.detach())
for p in ref.parameters():
    p.grad /= N_MB  # scale_grads=True: the gradients of the mean loss
ref_out = torch.cat(ref_outs)

def run(label, mine, make):
    mods = {s: copy.deepcopy(blocks[s]) for s in mine}
    stages = [PipelineStage(m, s, S, torch.device("cpu"), input_args=torch.zeros(BATCH // N_MB, D))
              for s, m in mods.items()]
    schedule = make(stages)
    first, last = 0 in mods, S - 1 in mods
    steps = []
    for _ in range(2):
        for m in mods.values():
            m.zero_grad(set_to_none=True)
        losses = []
        out = schedule.step(*([x] if first else []), target=y if last else None, losses=losses)
        steps.append((out, [l.item() for l in losses]))
    diffs = [float((p.grad - q.grad).abs().max()) for s, m in mods.items() for p, q in zip(m.parameters(), ref[s].parameters())]
    found = {"schedule": type(schedule).__name__, "stages": sorted(mods), "grads_max_diff": max(diffs),
             "multi": isinstance(schedule, PipelineScheduleMulti)}
    if last:
        found["losses"] = [l for _, l in steps]
        found["ref_losses"] = ref_losses
        found["out_max_diff"] = max(float((o - ref_out).abs().max()) for o, _ in steps)
    return found

import torchpatch
zbv = get_schedule_class("ZBVZeroBubble")
results = {"status": torchpatch.status().get("pipelining-zbv")}
results["lookup"] = zbv is ScheduleZBVZeroBubble and issubclass(zbv, _PipelineScheduleRuntime)
results["zbv"] = run("zbv", [rank, S - 1 - rank], lambda st: zbv(st, n_microbatches=N_MB, loss_fn=loss_fn))

# The runtime ZBV runs on (the served _PipelineScheduleRuntime on 2.4, torchpatch's subclass of 2.5's own
# on 2.5) with a CSV on torch's own looped placement (stage s on rank s % W):
# all forwards, then all backwards, each rank in stage order.
path = os.path.join(sys.argv[1], "schedule.csv")
if rank == 0:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for r in range(W):
            mine = [s for s in range(S) if s % W == r]
            row = [f"{s}F{mb}" for s in mine for mb in range(N_MB)]
            row += [f"{s}{'B' if s % 2 else 'I'}{mb}" for s in reversed(mine) for mb in range(N_MB)]
            row += [f"{s}W{mb}" for s in reversed(mine) for mb in range(N_MB) if s % 2 == 0]
            writer.writerow(row)
dist.barrier()

def runtime(st):
    schedule = zbv.__bases__[0](st, n_microbatches=N_MB, loss_fn=loss_fn)
    schedule._load_csv(path)
    return schedule

results["csv"] = run("csv", [s for s in range(S) if s % W == rank], runtime)
try:
    bad = [PipelineStage(copy.deepcopy(blocks[s]), s, S, torch.device("cpu"), input_args=torch.zeros(4, D))
           for s in range(S) if s % W == rank]
    ScheduleZBVZeroBubble(bad, n_microbatches=N_MB, loss_fn=loss_fn)
    results["looped_zbv"] = "accepted"
except ValueError as exc:
    results["looped_zbv"] = str(exc)

gathered = [None] * W
dist.all_gather_object(gathered, results)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@where_patch_applies("pipelining-zbv")
@pytest.mark.parametrize("nproc", [2])
def test_zbv_and_csv_runtime_match_one_process(tmp_path, nproc):
    script = tmp_path / "args"
    script.mkdir()
    proc = run_ranks(RANKS.replace("sys.argv[1]", repr(str(script))), nproc=nproc,
                     env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = rank_result(proc)
    S = 2 * nproc
    for rank, r in enumerate(ranks):
        assert r["lookup"] is True and r["status"] == "applied"
        assert r["zbv"]["stages"] == sorted([rank, S - 1 - rank])  # V: rank 0 holds stages 0 and 3
        assert r["csv"]["stages"] == [s for s in range(S) if s % nproc == rank]
        assert "ZBV places stage" in r["looped_zbv"], r["looped_zbv"]
        for key in ("zbv", "csv"):
            assert r[key]["multi"] and r[key]["grads_max_diff"] < 1e-12, (key, r[key])
    # The last stage (rank 0 under V, rank W-1 when looped) has the losses and the merged output.
    for key, holder in (("zbv", 0), ("csv", nproc - 1)):
        last = ranks[holder][key]
        assert last["out_max_diff"] < 1e-12
        assert len(last["losses"]) == 2 and all(len(l) == 4 for l in last["losses"])
        assert last["losses"] == [last["ref_losses"]] * 2  # zero grad between steps, same weights


ORDER = """
import json, sys, types
from torchpatch.patches.pipelining.pipelining_zbv import zbv_order
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

def native(rank, W, n):
    fake = types.SimpleNamespace(pp_group_size=W, num_stages=2 * W, _n_microbatches=n)
    return [None if a is None else str(a) for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, rank)]

out = {}
for W in (2, 3, 4):
    for n in (1, 4, 8, 9):
        for rank in range(W):
            mine = [None if a is None else repr(a) for a in zbv_order(rank, W, n)]
            out[f"{W},{n},{rank}"] = [mine == native(rank, W, n), mine[:6]]
print(json.dumps(out))
"""


@only_torch(">=2.13", "the reference: torch 2.13's own ScheduleZBVZeroBubble order")
def test_zbv_order_equals_torch_2_13():
    out = run_json(ORDER)
    assert all(same for same, _ in out.values()), {k: v for k, v in out.items() if not v[0]}


@only_torch(">=2.6", "torch has both classes: nothing is served")
def test_inactive_where_torch_has_them():
    out = run_json(
        """
        import json, torchpatch
        from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _PipelineScheduleRuntime
        print(json.dumps({"module": ScheduleZBVZeroBubble.__module__, "runtime": _PipelineScheduleRuntime.__module__,
                          "status": torchpatch.status().get("pipelining-zbv")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out == {"module": "torch.distributed.pipelining.schedules",
                   "runtime": "torch.distributed.pipelining.schedules", "status": None}

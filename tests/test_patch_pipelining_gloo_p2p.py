"""pipelining-gloo-p2p: pipeline schedules wait for every send and receive of a batch on gloo, torch
2.4-2.7. Natively, torch 2.4's ``Schedule1F1B`` on 2 gloo ranks (2 stages, 4 microbatches) waits for
the last work of each fused send/receive batch only and times out in a receive (bounded here by a
10 s process-group timeout). With torchpatch, 1F1B (stages with and without ``input_args``) and
Interleaved1F1B (4 stages, 2 per rank) give the per-microbatch losses, the output and the gradients of
the same model on one process, for two steps. On torch >= 2.8 the same script runs torch's own fixed
``_batch_p2p`` (the reference) and the patch stays out of the way."""

import json

import pytest

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_ranks, where_patch_applies

# Shared by both scripts: a float64 model of 4 blocks, its batch, and the one-process reference
# (microbatch by microbatch; torch >= 2.7 averages the microbatches' gradients, 2.4-2.6 sum them).
MODEL = """
import copy, datetime, inspect, json, os, time, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleInterleaved1F1B
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PG_TIMEOUT))
rank = dist.get_rank()
torch.set_default_dtype(torch.float64)
D, BATCH, N_MB = 8, 16, 4
torch.manual_seed(0)
blocks = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)]
x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
loss_fn = nn.MSELoss()

def make_stage(module, index, n_stages, input_args):
    if input_args:
        return PipelineStage(module, index, n_stages, torch.device("cpu"), input_args=torch.zeros(BATCH // N_MB, D))
    return PipelineStage(module, index, n_stages, torch.device("cpu"))

def reference(groups, mean):
    ref = [copy.deepcopy(nn.Sequential(*(blocks[b] for b in group))) for group in groups]
    losses, outs = [], []
    for xm, ym in zip(x.tensor_split(N_MB), y.tensor_split(N_MB)):
        out = xm
        for stage in ref:
            out = stage(out)
        loss = loss_fn(out, ym)
        (loss / N_MB if mean else loss).backward()
        losses.append(loss.item())
        outs.append(out.detach())
    return ref, losses, torch.cat(outs)
"""

NATIVE = MODEL.replace("PG_TIMEOUT", "10") + """
groups = [[0, 1], [2, 3]]  # 2 stages, one per rank
module = copy.deepcopy(nn.Sequential(*(blocks[b] for b in groups[rank])))
schedule = Schedule1F1B(make_stage(module, rank, 2, True), n_microbatches=N_MB, loss_fn=loss_fn)
start = time.monotonic()
try:
    schedule.step(*([x] if rank == 0 else []), target=y if rank == 1 else None, losses=[])
    error = None
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
with open(os.path.join(OUT_DIR, f"rank{rank}.json"), "w") as f:  # (two ranks' prints may interleave)
    json.dump({"rank": rank, "error": error, "seconds": time.monotonic() - start}, f)
os._exit(0)  # no barrier: the process group is broken
"""


@where_patch_applies("pipelining-gloo-p2p", "torch 2.8 waits for every work")
def test_native_1f1b_on_gloo_times_out(tmp_path):
    proc = run_ranks(NATIVE.replace("OUT_DIR", repr(str(tmp_path))), env=clean_env(), tmp_path=tmp_path, timeout=90)
    paths = [tmp_path / f"rank{rank}.json" for rank in (0, 1)]
    assert all(p.exists() for p in paths), (proc.stdout, proc.stderr[-4000:])
    found = [json.loads(p.read_text()) for p in paths]
    assert all(r["error"] is not None and r["error"].startswith("RuntimeError: ") for r in found), found
    timed_out = [r for r in found if "Timed out waiting 10000ms for recv operation to complete" in r["error"]]
    assert timed_out, found
    assert all(r["seconds"] >= 9.5 for r in timed_out), found  # it hung until the process group's timeout


RANKS = MODEL.replace("PG_TIMEOUT", "60") + """
def run(schedule_cls, groups, input_args):
    mine = [s for s in range(len(groups)) if s % 2 == rank]  # stage s on rank s % 2
    modules = {s: copy.deepcopy(nn.Sequential(*(blocks[b] for b in groups[s]))) for s in mine}
    stages = [make_stage(modules[s], s, len(groups), input_args) for s in mine]
    multi = schedule_cls is ScheduleInterleaved1F1B
    schedule = schedule_cls(stages if multi else stages[0], n_microbatches=N_MB, loss_fn=loss_fn)
    mean = "scale_grads" in inspect.signature(schedule_cls).parameters
    ref, ref_losses, ref_out = reference(groups, mean)
    first, last = 0 in mine, len(groups) - 1 in mine
    steps = []
    for _ in range(2):
        for m in modules.values():
            m.zero_grad(set_to_none=True)
        losses = []
        out = schedule.step(*([x] if first else []), target=y if last else None, losses=losses)
        steps.append([[l.item() for l in losses], None if out is None else float((out - ref_out).abs().max())])
    grads = max(float((p.grad - q.grad).abs().max()) for s in mine for p, q in zip(modules[s].parameters(), ref[s].parameters()))
    return {"stages": mine, "steps": steps, "ref_losses": ref_losses if last else None, "grads_max_diff": grads, "mean": mean}

results = {
    "1f1b": run(Schedule1F1B, [[0, 1], [2, 3]], input_args=True),
    "1f1b_inferred_shapes": run(Schedule1F1B, [[0, 1], [2, 3]], input_args=False),
    "interleaved_1f1b": run(ScheduleInterleaved1F1B, [[0], [1], [2], [3]], input_args=True),
}
from torch.distributed.pipelining import schedules
results["batch_p2p"] = schedules._batch_p2p.__module__
try:
    import torchpatch
    results["status"] = torchpatch.status().get("pipelining-gloo-p2p")
except ImportError:
    results["status"] = None
gathered = [None] * 2
dist.all_gather_object(gathered, results)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


def run_schedules(tmp_path):
    proc = run_ranks(RANKS, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = rank_result(proc)
    for key in ("1f1b", "1f1b_inferred_shapes", "interleaved_1f1b"):
        assert [r[key]["stages"] for r in ranks] == ([[0, 2], [1, 3]] if key == "interleaved_1f1b" else [[0], [1]])
        for r in ranks:
            assert r[key]["grads_max_diff"] < 1e-12, (key, r[key])
        found = ranks[1][key]  # the last stage is on rank 1: its losses and output
        assert len(found["steps"]) == 2
        for losses, out_diff in found["steps"]:
            assert losses == pytest.approx(found["ref_losses"], rel=1e-12, abs=0), (key, found)
            assert out_diff < 1e-12, (key, found)
    return ranks


@where_patch_applies("pipelining-gloo-p2p")
def test_schedules_on_gloo_match_one_process(tmp_path):
    ranks = run_schedules(tmp_path)
    assert [r["status"] for r in ranks] == ["applied"] * 2
    assert [r["batch_p2p"] for r in ranks] == ["torchpatch.patches.pipelining.pipelining_gloo_p2p"] * 2


@only_torch(">=2.8", "the reference: torch's own _batch_p2p, which waits for every work")
def test_inactive_and_native_semantics(tmp_path):
    ranks = run_schedules(tmp_path)
    assert [r["status"] for r in ranks] == [None, None]
    assert [r["batch_p2p"] for r in ranks] == ["torch.distributed.pipelining.schedules"] * 2

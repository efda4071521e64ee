"""pipelining-gloo-warmup: a pipeline schedule's P2P warm-up sends what its peer receives, torch 2.9.
2 gloo ranks, a float64 model of 4 blocks with the default dtype left float32 (as torchtitan's):
natively on torch 2.9 the first ``step()`` aborts both processes in gloo (``op.preamble.length <=
op.nbytes. 8 vs 4``: an int64 sent into a float32). With torchpatch, Schedule1F1B (torchtitan's
``1F1B``), ScheduleGPipe (2 stages) and ScheduleInterleaved1F1B (4 stages, 2 per rank) give, for two
SGD steps, the loss and the gradients of the same model on one process with the full batch. On torch
>= 2.10 the same script passes natively and the patch stays out; the hook's probe tells the two
kinds of torch apart without communicating."""

import pytest

from conftest import LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, ranks_result, run_json, run_ranks
from conftest import where_patch_applies

PATCH_ID = "pipelining-gloo-warmup"

SCRIPT = """
import copy, datetime, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank = dist.get_rank()
D, BATCH, N_MB, F64 = 8, 16, 4, torch.float64  # float64 weights; the default dtype stays float32
torch.manual_seed(0)
blocks = [nn.Sequential(nn.Linear(D, D, dtype=F64), nn.Tanh()) for _ in range(4)]
x, y = torch.randn(BATCH, D, dtype=F64), torch.randn(BATCH, D, dtype=F64)
loss_fn = nn.MSELoss()

def run(schedule_cls, n_stages):
    per = len(blocks) // n_stages
    mine = [s for s in range(n_stages) if s % 2 == rank]  # stage s on rank s % 2
    modules = {s: copy.deepcopy(nn.Sequential(*blocks[s * per:(s + 1) * per])) for s in mine}
    stages = [PipelineStage(modules[s], s, n_stages, torch.device("cpu")) for s in mine]
    schedule = schedule_cls(stages if n_stages > 2 else stages[0], n_microbatches=N_MB, loss_fn=loss_fn)
    ref = copy.deepcopy(nn.Sequential(*blocks))  # one process, the full batch
    opt = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    first, last = 0 in mine, n_stages - 1 in mine
    steps = []
    for _ in range(2):
        opt.zero_grad()
        losses = []
        schedule.step(*([x] if first else []), target=y if last else None, losses=losses)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        grads = max(float((p.grad - q.grad).abs().max()) for s in mine
                    for p, q in zip(modules[s].parameters(), ref[s * per:(s + 1) * per].parameters()))
        steps.append({"loss": float(sum(losses) / len(losses)) if last else None, "ref_loss": ref_loss.item(),
                      "grads_max_diff": grads})
        opt.step()
        ref_opt.step()
    return {"stages": mine, "last": last, "steps": steps}

out = {"1f1b": run(Schedule1F1B, 2), "gpipe": run(ScheduleGPipe, 2), "interleaved_1f1b": run(ScheduleInterleaved1F1B, 4)}
try:
    import torchpatch
    out["status"] = torchpatch.status().get(PATCH_ID)
except ImportError:
    out["status"] = None
gathered = [None] * 2
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)).replace("PATCH_ID", repr(PATCH_ID)) + LEAVE_WITHOUT_TEARDOWN


def check_equals_one_process(ranks: list) -> None:
    """Every schedule's loss (the mean of its microbatches') and gradients, both steps, are the one
    process's; the second step moved the weights."""
    for key in ("1f1b", "gpipe", "interleaved_1f1b"):
        assert [r[key]["stages"] for r in ranks] == ([[0, 2], [1, 3]] if key == "interleaved_1f1b" else [[0], [1]])
        for r in ranks:
            assert len(r[key]["steps"]) == 2
            for step in r[key]["steps"]:
                assert step["grads_max_diff"] < 1e-12, (key, r)
        steps = ranks[1][key]["steps"]  # the last stage is on rank 1
        assert ranks[1][key]["last"]
        for step in steps:
            assert step["loss"] == pytest.approx(step["ref_loss"], rel=1e-12, abs=0), (key, steps)
        assert steps[0]["ref_loss"] != steps[1]["ref_loss"]


@where_patch_applies(PATCH_ID)
def test_native_first_step_aborts_in_gloo(tmp_path):
    proc = run_ranks(SCRIPT, env=clean_env(), tmp_path=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match expected size" in proc.stderr, (
        proc.stderr[-4000:])


@where_patch_applies(PATCH_ID)
def test_schedules_on_gloo_equal_one_process(tmp_path):
    ranks = ranks_result(SCRIPT, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path, timeout=180)
    check_equals_one_process(ranks)
    assert [r["status"] for r in ranks] == ["applied"] * 2


@only_torch(">=2.10", "torch's own warm-up (float32 both ways, or none): the reference")
def test_native_schedules_on_fixed_torch(tmp_path):
    check_equals_one_process(ranks_result(SCRIPT, env=clean_env(), tmp_path=tmp_path, timeout=180))


STAYS_OUT = """
import json, torch.distributed.pipelining.stage as stage, torchpatch
method = vars(stage._PipelineStageBase).get("_get_init_p2p_neighbors_ops")
print(json.dumps({"status": torchpatch.status().get(PATCH_ID), "own": getattr(method, "__wrapped__", None) is None}))
""".replace("PATCH_ID", repr(PATCH_ID))


@only_torch(">=2.10", "fixed upstream")
def test_stays_out_where_torch_is_fixed():
    assert run_json(STAYS_OUT, env=clean_env(TORCHPATCH="1")) == {"status": None, "own": True}


PROBE = """
import json, torch.distributed.pipelining.stage as stage
from torchpatch.patches.pipelining.pipelining_gloo_warmup import warmup_dtypes
print(json.dumps(sorted(str(d) for d in warmup_dtypes(stage._PipelineStageBase._get_init_p2p_neighbors_ops))))
"""


@where_patch_applies(PATCH_ID)
def test_probe_sees_an_int64_sent_into_a_float32():
    """The hook's probe, asked without TORCHPATCH, for a middle stage (a receive and a send each way)."""
    assert run_json(PROBE, env=clean_env()) == ["torch.float32"] * 2 + ["torch.int64"] * 2


@only_torch(">=2.10,<2.15", "fixed upstream; torch 2.15 has no such warm-up")
def test_probe_sees_float32_both_ways_where_torch_is_fixed():
    assert run_json(PROBE, env=clean_env()) == ["torch.float32"] * 4

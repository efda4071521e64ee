"""pipelining-interleaved-zb: ScheduleInterleavedZeroBubble on torch 2.4, on pipelining-zbv's runtime.

Two ranks (gloo), 4 stages (2 per rank, loop placement), 4 and 8 microbatches, float64: outputs,
per-microbatch losses and every stage's gradients equal the same model on one process (the full
batch's loss, the mean of the microbatches', backwarded once), served on 2.4
and natively from 2.5 on with the same assertions; ``get_schedule_class`` finds it; the action order
equals torch's own (2.13 and later) for several group sizes, stage counts and microbatch counts.
"""

from conftest import (
    clean_env, only_torch, patch_applies_here, ranks_result, run_json, run_py, through_patch_range,
    where_patch_applies
)
from pipeline_scripts import schedule_script

ID = "pipelining-interleaved-zb"


@where_patch_applies(ID, "torch 2.4 has pipelining without it")
def test_native_import_error():
    proc = run_py("from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble")
    assert "ImportError: cannot import name 'ScheduleInterleavedZeroBubble'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = schedule_script("ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", 16, ID, """
for n_mb in (4, 8):
    with torch.no_grad():
        ref_losses = [loss_fn(o, t).item() for o, t in zip(ref_out.tensor_split(n_mb), y.tensor_split(n_mb))]
    mine = [rank, rank + W]
    mods = {s: copy.deepcopy(blocks[s]) for s in mine}
    stages = [PipelineStage(mods[s], s, S, torch.device("cpu"), input_args=torch.zeros(BATCH // n_mb, D))
              for s in mine]
    schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=n_mb, loss_fn=loss_fn)
    losses = []
    result = schedule.step(*([x] if rank == 0 else []), target=y if rank == W - 1 else None, losses=losses)
    grads = max(float((p.grad - q.grad).abs().max())
                for s in mine for p, q in zip(mods[s].parameters(), ref[s].parameters()))
    found = {"grads": grads}
    if rank == W - 1:
        found["losses_diff"] = max(abs(a.item() - b) for a, b in zip(losses, ref_losses))
        found["n_losses"] = len(losses)
        found["out"] = float((result - ref_out).abs().max())
    out[n_mb] = found
""")


@through_patch_range(ID, "pipelining came with torch 2.4")
def test_two_ranks_four_stages_match_one_process(tmp_path):
    ranks = ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=240)
    for rank, out in enumerate(ranks):
        assert out["lookup"] is True and out["status"] == ("applied" if patch_applies_here(ID) else None)
        for n_mb in ("4", "8"):
            assert out[n_mb]["grads"] < 1e-12, (rank, out)
    for n_mb in ("4", "8"):
        last = ranks[-1][n_mb]
        assert last["n_losses"] == int(n_mb) and last["losses_diff"] < 1e-12 and last["out"] < 1e-12, last


ORDER = """
import json, torch, torch.distributed as dist, torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble
from torchpatch.patches.pipelining.pipelining_interleaved_zb import interleaved_zb_orders
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

def outcome(make):
    try:
        return {str(r): [None if a is None else str(a) for a in ops] for r, ops in make().items()}
    except ValueError as exc:
        return "ValueError: " + str(exc)

out = {}
for W in (2, 3, 4):
    group = dist.new_group(list(range(W)))
    for n_local in (2, 3):
        for n in (1, 2, 4, 6, 8, 9):
            def native():
                stages = [PipelineStage(nn.Linear(2, 2), i * W, n_local * W, torch.device("cpu"), input_args=torch.zeros(1, 2),
                                        output_args=torch.zeros(1, 2), group=group) for i in range(n_local)]
                return ScheduleInterleavedZeroBubble(stages, n_microbatches=n, loss_fn=nn.MSELoss()).pipeline_order
            ours, theirs = outcome(lambda: interleaved_zb_orders(W, n_local, n)), outcome(native)
            out[f"{W},{n_local},{n}"] = [ours == theirs, str(theirs)[:80]]
print(json.dumps(out))
"""


@only_torch(">=2.13", "the reference: torch's own ScheduleInterleavedZeroBubble order")
def test_order_equals_torch():
    out = run_json(ORDER)
    assert all(same for same, _ in out.values()), {k: v for k, v in out.items() if not v[0]}
    assert any(text.startswith("ValueError") for _, text in out.values())  # 9 microbatches in 2 rounds

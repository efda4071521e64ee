"""pipelining-dualpipev: ScheduleDualPipeV on torch 2.4-2.8, on pipelining-zbv's runtime (2.5-2.8: not
torch's own runtime, which gloo refuses for a rank's two V stages; not in CI's matrix: tested on 2.5.1 and
2.8.0 by hand at 7c8f71b, not in CI).

Two ranks (gloo), 4 stages in a V (rank r holds stages r and 3-r), 4, 6 and 8 microbatches, float64:
outputs, per-microbatch losses and every stage's gradients equal the same model on one process (the
full batch's loss, the mean of the microbatches', backwarded once), served on 2.4-2.8 and natively on
2.15 with the same assertions, as are 2.15's errors (not 2 stages per rank, fewer microbatches than
stages); the action order, overlapped steps as their forward then their backward, equals torch's own
(2.13 and later) for several group sizes and microbatch counts.
"""

import pytest
from conftest import (
    clean_env, only_torch, patch_applies_here, ranks_result, run_json, torch_matches, where_patch_applies
)
from pipeline_scripts import schedule_script

ID = "pipelining-dualpipev"
PROBE = """
import json, torch.distributed.pipelining.schedules as schedules, torchpatch
print(json.dumps([hasattr(schedules, "ScheduleDualPipeV"), torchpatch.status().get("pipelining-dualpipev")]))
"""


@where_patch_applies(ID, "torch 2.4-2.8 have pipelining without it")
def test_missing_natively_served_with_torchpatch():
    assert run_json(PROBE, env=clean_env()) == [False, None]
    assert run_json(PROBE, env=clean_env(TORCHPATCH="1")) == [True, "applied"]


SCRIPT = schedule_script("ScheduleDualPipeV", "DualPipeV", 24, ID, """
mine = [rank, S - 1 - rank]

def stages_of(n_mb, which):
    mods = {s: copy.deepcopy(blocks[s]) for s in which}
    return mods, [PipelineStage(mods[s], s, S, torch.device("cpu"), input_args=torch.zeros(BATCH // n_mb, D))
                  for s in which]

def error(call):
    try:
        call()
        return None
    except ValueError as exc:
        return str(exc)

out["errors"] = [error(lambda: ScheduleDualPipeV(stages_of(4, mine[:1])[1], n_microbatches=4, loss_fn=loss_fn)),
                 error(lambda: ScheduleDualPipeV(stages_of(2, mine)[1], n_microbatches=2, loss_fn=loss_fn))]
for n_mb in (4, 6, 8):
    with torch.no_grad():
        ref_losses = [loss_fn(o, t).item() for o, t in zip(ref_out.tensor_split(n_mb), y.tensor_split(n_mb))]
    mods, stages = stages_of(n_mb, mine)
    schedule = ScheduleDualPipeV(stages, n_microbatches=n_mb, loss_fn=loss_fn)
    losses = []
    result = schedule.step(*([x] if rank == 0 else []), target=y if rank == 0 else None, losses=losses)
    grads = max(float((p.grad - q.grad).abs().max())
                for s in mine for p, q in zip(mods[s].parameters(), ref[s].parameters()))
    found = {"grads": grads}
    if rank == 0:
        found["losses_diff"] = max(abs(a.item() - b) for a, b in zip(losses, ref_losses))
        found["n_losses"] = len(losses)
        found["out"] = float((result - ref_out).abs().max())
    out[n_mb] = found
""")


@pytest.mark.skipif(not (patch_applies_here(ID) or torch_matches(">=2.15")),
                    reason="served on torch 2.4-2.8; torch 2.15's own, the reference")
def test_two_ranks_four_stages_match_one_process(tmp_path):
    ranks = ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=240)
    for rank, out in enumerate(ranks):
        assert out["lookup"] is True and out["status"] == ("applied" if patch_applies_here(ID) else None)
        assert out["errors"] == ["ZBV requires exactly 2 stages per rank, but got 1.",
                                 "DualPipeV requires at least as many microbatches as stages, but got 2 "
                                 "microbatches and 4 stages."], out["errors"]
        for n_mb in ("4", "6", "8"):
            assert out[n_mb]["grads"] < 1e-12, (rank, out)
    for n_mb in ("4", "6", "8"):
        first = ranks[0][n_mb]
        assert first["n_losses"] == int(n_mb) and first["losses_diff"] < 1e-12 and first["out"] < 1e-12, first


ORDER = """
import json, torch, torch.distributed as dist, torch.nn as nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import ScheduleDualPipeV
from torchpatch.patches.pipelining.pipelining_dualpipev import dualpipev_order
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)

def flat(ops):  # an overlapped step as its forward, then its backward
    return [str(s) for a in ops for s in (getattr(a, "sub_actions", None) or [a])]

out = {}
for W in (2, 3, 4):
    group = dist.new_group(list(range(W)))
    for n in (2 * W, 2 * W + 1, 3 * W, 4 * W + 2):
        stages = [PipelineStage(nn.Linear(2, 2), s, 2 * W, torch.device("cpu"), input_args=torch.zeros(1, 2),
                                output_args=torch.zeros(1, 2), group=group) for s in (0, 2 * W - 1)]
        theirs = ScheduleDualPipeV(stages, n_microbatches=n, loss_fn=nn.MSELoss()).pipeline_order
        out[f"{W},{n}"] = [all(flat(theirs[r]) == [str(a) for a in dualpipev_order(r, W, n)] for r in range(W)),
                           flat(theirs[W - 1])[:12]]
print(json.dumps(out))
"""


@only_torch(">=2.13", "the reference: torch's own ScheduleDualPipeV order")
def test_order_equals_torch():
    out = run_json(ORDER)
    assert all(same for same, _ in out.values()), {k: v for k, v in out.items() if not v[0]}

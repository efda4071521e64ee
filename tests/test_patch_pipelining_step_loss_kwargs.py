"""pipelining-step-loss-kwargs: ``schedule.step(..., loss_kwargs={...})``.

On 2 ranks (gloo), float64, a GPipe pipeline of two stages steps once with a loss function that takes a
keyword (``scale``), given as ``loss_kwargs={"scale": 3.0}``, with whole-batch inputs and with inputs
split into microbatches beforehand (``arg_mbs``/``target_mbs``, torchtitan 0.3's call): the last
stage's microbatch losses must be ``loss_fn(output, target, scale=3.0)`` of the same blocks on one
process (``pipeline_scripts``), and every stage's gradients 3 times the one-process mean loss's (torch
2.4-2.6's schedules sum the microbatches' gradients where 2.7+ average them: 12 times there). Torch
2.13+ takes ``loss_kwargs`` natively (the newest torch validates the expectation); 2.4-2.9 natively hand
it to the model (``TypeError``, shown with one stage on one rank).
"""

from conftest import clean_env, patch_applies_here, ranks_result, through_patch_range, where_patch_applies
from pipeline_scripts import schedule_script

BODY = """
def scaled(output, target, *, scale):
    return loss_fn(output, target) * scale

ref_losses = [3.0 * loss_fn(o, t) for o, t in zip(ref_out.detach().chunk(4), y.chunk(4))]
for form in ("whole", "presplit"):
    mine = copy.deepcopy(blocks[2 * rank: 2 * rank + 2])
    schedule = ScheduleGPipe(PipelineStage(nn.Sequential(*mine), rank, W, torch.device("cpu")), n_microbatches=4,
                             loss_fn=scaled)
    losses = []
    last = {"losses": losses}
    if form == "whole":
        inputs, last["target"] = ((x,) if rank == 0 else ()), y
        call = lambda: schedule.step(*inputs, loss_kwargs={"scale": 3.0}, **(last if rank == W - 1 else {}))
    else:
        last["target_mbs"] = list(y.chunk(4))
        first = {"arg_mbs": [(c,) for c in x.chunk(4)]} if rank == 0 else {}
        call = lambda: schedule.step(loss_kwargs={"scale": 3.0}, **first, **(last if rank == W - 1 else {}))
    try:
        call()
    except TypeError as exc:
        out[form] = "TypeError" if "scale" in str(exc) or "loss_kwargs" in str(exc) else str(exc)
        continue
    losses_equal = rank != W - 1 or (len(losses) == 4 and all(
        torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(losses, ref_losses)))
    mean = getattr(schedule, "scale_grads", False)  # torch 2.4-2.6's schedules sum the microbatches' gradients
    grads_equal = all(torch.allclose(p.grad, (3.0 if mean else 12.0) * q.grad, rtol=1e-10, atol=1e-14)
                      for m, r in zip(mine, ref[2 * rank: 2 * rank + 2]) for p, q in zip(m.parameters(), r.parameters()))
    out[form] = "reference" if losses_equal and grads_equal else "differs"
"""

SCRIPT = schedule_script("ScheduleGPipe", "GPipe", 8, "pipelining-step-loss-kwargs", BODY)

# natively the first stage's model gets the keyword: one stage on one rank, so no rank waits for it
ONE_STAGE = schedule_script("ScheduleGPipe", "GPipe", 8, "pipelining-step-loss-kwargs", """
schedule = ScheduleGPipe(PipelineStage(copy.deepcopy(blocks), 0, 1, torch.device("cpu")), n_microbatches=4,
                         loss_fn=lambda output, target, *, scale: loss_fn(output, target) * scale)
try:
    schedule.step(x, target=y, loss_kwargs={"scale": 3.0})
    out["whole"] = "stepped"
except TypeError as exc:
    out["whole"] = "TypeError" if "loss_kwargs" in str(exc) else str(exc)
""")


@where_patch_applies("pipelining-step-loss-kwargs", "step has no loss_kwargs")
def test_native_step_hands_loss_kwargs_to_the_model(tmp_path):
    for out in ranks_result(ONE_STAGE, nproc=1, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1", TORCHPATCH_PIPELINING_STEP_LOSS_KWARGS="0"), timeout=180):
        assert out["status"] is None
        assert out["whole"] == "TypeError", out


@through_patch_range("pipelining-step-loss-kwargs", "pipeline schedules on gloo")
def test_loss_kwargs_reach_the_loss(tmp_path):
    for out in ranks_result(SCRIPT, tmp_path=tmp_path, env=clean_env(TORCHPATCH="1"), timeout=180):
        assert out["status"] == ("applied" if patch_applies_here("pipelining-step-loss-kwargs") else None), out
        assert (out["whole"], out["presplit"]) == ("reference", "reference"), out

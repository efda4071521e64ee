"""pipelining-backward-requires-autograd: the looped schedules take ``backward_requires_autograd=``.

Two ranks (gloo), float64 blocks (Linear + Tanh), MSE loss, 4 microbatches of a batch of 8,
ScheduleInterleaved1F1B and ScheduleLoopedBFS (two stages per rank), as torchtitan 0.3.0 builds them
(``scale_grads=False``: the summed microbatch gradients). Natively on torch 2.4-2.9 the keyword is a
``TypeError``. With torchpatch (and natively on 2.10+), ``backward_requires_autograd=True`` gives bit for
bit the gradients of the schedule built without it, which are 4 times those of the same model on one
process over the whole batch, and keeps the flag as ``schedule._backward_requires_autograd``; under
``torch.no_grad()`` the step refuses (``RuntimeError``; checked on 2.9+: 2.4's has no such check). False: ``NotImplementedError``
where the patch applies (no custom backward functions there); natively (2.15) it is built and, with
gradients on, steps the same. Every looped schedule (torch's, and those torchpatch serves on older torches) has
the keyword in its signature.
"""

from conftest import (
    PIPELINING_GLOO_WARMUP, clean_env, patch_applies_here, ranks_result, through_patch_range, torch_matches,
    where_patch_applies
)
from pipeline_scripts import merged_tail

ID = "pipelining-backward-requires-autograd"
SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS")

SCRIPT = """
import copy, inspect, json, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules
GLOO_WARMUP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.set_default_dtype(torch.float64)
n_mb, batch, dim, n_stages = 4, 8, 4, 2 * world
x = torch.randn(batch, dim, generator=torch.Generator().manual_seed(1))
y = torch.randn(batch, dim, generator=torch.Generator().manual_seed(2))
loss_fn = nn.MSELoss()
torch.manual_seed(0)
blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n_stages))
ref = copy.deepcopy(blocks)
ref_out = x
for block in ref:
    ref_out = block(ref_out)
loss_fn(ref_out, y).backward()
mine = list(range(rank, n_stages, world))


def outcome(exc):
    return f"{type(exc).__name__}: {exc}"


def step(name, **flag):
    mods = {s: copy.deepcopy(blocks[s]) for s in mine}
    stages = [PipelineStage(mods[s], s, n_stages, torch.device("cpu"), input_args=torch.zeros(batch // n_mb, dim))
              for s in mine]
    schedule = getattr(schedules, name)(stages, n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=False, **flag)
    schedule.step(*([x] if rank == 0 else []), target=y if rank == world - 1 else None)
    return schedule, [p.grad for s in mine for p in mods[s].parameters()]


out = {}
looped = ("ScheduleLoopedBFS", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
          "ScheduleDualPipeV")  # torch's own or, on older torches, served by torchpatch
out["signatures"] = sorted(name for name in looped if hasattr(schedules, name)
                           and "backward_requires_autograd" not in inspect.signature(getattr(schedules, name)).parameters)
sums = [q.grad * n_mb for s in mine for q in ref[s].parameters()]
for name in SCHEDULES:
    _, default = step(name)
    for flag in (True, False):
        key = f"{name}/{flag}/{rank}"
        try:
            schedule, grads = step(name, backward_requires_autograd=flag)
        except (TypeError, NotImplementedError) as exc:
            out[key] = outcome(exc)
            continue
        out[key] = {"kept": schedule._backward_requires_autograd,
                    "as_without": all(torch.equal(g, d) for g, d in zip(grads, default)),
                    "sum": all(torch.allclose(g, r, rtol=1e-12, atol=0) for g, r in zip(grads, sums))}
        if flag and NO_GRAD_CHECK:  # torch 2.4's looped step has no such check: its ranks' backwards would hang
            try:
                with torch.no_grad():
                    schedule.step(*([x] if rank == 0 else []), target=y if rank == world - 1 else None)
                out[f"{name}/no_grad/{rank}"] = "stepped"
            except RuntimeError as exc:
                out[f"{name}/no_grad/{rank}"] = outcome(exc)
"""


def _run(tmp_path, **env: str) -> dict:
    script = (SCRIPT.replace("GLOO_WARMUP", PIPELINING_GLOO_WARMUP).replace("SCHEDULES", repr(SCHEDULES))
              .replace("NO_GRAD_CHECK", repr(torch_matches(">=2.9"))))
    return ranks_result(script + merged_tail(ID), tmp_path=tmp_path, env=clean_env(**env), timeout=240)


@where_patch_applies(ID, "the keyword came with torch 2.10")
def test_native_keyword_is_a_type_error(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1", TORCHPATCH_PIPELINING_BACKWARD_REQUIRES_AUTOGRAD="0")
    assert out.pop("status") == [None, None]
    assert set(out.pop("signatures")) >= set(SCHEDULES)
    for key, value in out.items():
        assert value.startswith("TypeError: ") and "unexpected keyword argument 'backward_requires_autograd'" in value, \
            (key, value)


@through_patch_range(ID)
def test_true_is_the_autograd_step_and_false_refused_where_served(tmp_path):
    out = _run(tmp_path, TORCHPATCH="1")
    assert out.pop("status") == (["applied"] * 2 if patch_applies_here(ID) else [None, None])
    assert out.pop("signatures") == []
    for key in [k for k in out if "/no_grad/" in k]:
        assert out.pop(key).startswith("RuntimeError: step() requires gradients"), key
    for key, value in out.items():
        flag = key.split("/")[1]
        if flag == "True" or not patch_applies_here(ID):
            assert value == {"kept": flag == "True", "as_without": True, "sum": True}, (key, value)
        else:
            assert value.startswith("NotImplementedError: ") and "backward_requires_autograd=False" in value, \
                (key, value)

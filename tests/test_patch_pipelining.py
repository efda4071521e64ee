"""pipelining: torch.distributed.pipelining served on torch 2.1-2.3, a real pipeline runtime.

On 2.1: the native ModuleNotFoundError; with TORCHPATCH=1 the package and its submodules, pipeline()
and SplitPoint raising, and on 2 and 4 ranks GPipe, 1F1B, Interleaved 1F1B and Looped BFS steps
whose outputs, per-microbatch losses and every stage's gradients equal the same model run on one
process; an exception in one stage ends every rank with a clear error, with the failing process
gone (at once) or hanging on (within the process group's timeout). On 2.4+ the patch stays out of
the way; on 2.13 the backport, loaded directly, agrees with torch's own pipelining.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, free_port, only_torch, rank_result, run_json, run_py,
    run_ranks
)

SERVED = ">=2.1,<2.4"

# Every rank builds the same model of S = world * per_rank stages (Linear + tanh, handing an integer
# counter along: two activations, one not differentiable) and runs it one process alone, microbatch
# by microbatch with one backward each; then through each pipeline library in LIBS, two steps (zero
# grad between), then eval(). Rank 0 prints what every rank found.
EQUALITY = """
import copy, datetime, json, sys, torch, torch.distributed as dist, torch.nn as nn
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, W = dist.get_rank(), dist.get_world_size()
D, BATCH = 8, 16
CLASSES = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "Interleaved1F1B": "ScheduleInterleaved1F1B",
           "LoopedBFS": "ScheduleLoopedBFS"}
LIBS = LIBS_SOURCE
CONFIGS = CONFIGS_SOURCE


class Block(nn.Module):
    def __init__(self, last):
        super().__init__()
        self.lin, self.last = nn.Linear(D, D), last

    def forward(self, h, count=None):
        if count is None:
            count = torch.zeros(h.shape[0], dtype=torch.int64)
        h = torch.tanh(self.lin(h)) + 0.01 * count.unsqueeze(1)
        return h if self.last else (h, count + 1)


def apply(blocks, h):
    for b in blocks:
        h = b(*h) if isinstance(h, tuple) else b(h)
    return h


def reference(blocks, x, y, n_mb, loss_fn, scale):
    losses, outs = [], []
    for xm, ym in zip(x.tensor_split(n_mb), y.tensor_split(n_mb)):
        out = apply(blocks, xm)
        loss = loss_fn(out, ym)
        loss.backward()
        losses.append(loss.item())
        outs.append(out.detach())
    if scale:
        for p in blocks.parameters():
            p.grad /= n_mb
    return torch.cat(outs), losses


def run(name, per_rank, n_mb, scale):
    S = W * per_rank
    torch.manual_seed(100 * S + n_mb)
    blocks = nn.ModuleList(Block(s == S - 1) for s in range(S))
    x, y = torch.randn(BATCH, D), torch.randn(BATCH, D)
    loss_fn = nn.MSELoss()
    ref = copy.deepcopy(blocks)
    ref_out, ref_losses = reference(ref, x, y, n_mb, loss_fn, scale)
    with torch.no_grad():
        ref_eval = apply(ref, x)
    found = {}
    for label, lib in LIBS.items():
        mods = {s: copy.deepcopy(blocks[s]) for s in range(rank, S, W)}
        stages = [lib.PipelineStage(m, s, S, torch.device("cpu")) for s, m in mods.items()]
        cls = getattr(lib, CLASSES[name])
        schedule = cls(stages if per_rank > 1 or name in ("Interleaved1F1B", "LoopedBFS") else stages[0],
                       n_microbatches=n_mb, loss_fn=loss_fn, scale_grads=scale)
        first, last = 0 in mods, S - 1 in mods
        steps = []
        for _ in range(2):
            for m in mods.values():
                m.zero_grad(set_to_none=True)
            losses = []
            out = schedule.step(*([x] if first else []), target=y if last else None, losses=losses)
            steps.append({"out": out, "losses": [l.item() for l in losses]})
        grads = [(p.grad.clone(), q.grad) for s, m in mods.items() for p, q in zip(m.parameters(), ref[s].parameters())]
        eval_losses = []  # (torch 2.13's eval() divides the gradients by n_microbatches again: read them first)
        with torch.no_grad():
            evaluated = schedule.eval(*([x] if first else []), target=y if last else None, losses=eval_losses)
        found[label] = {
            "schedule": type(schedule).__name__,
            "stages": sorted(mods),
            "grads_equal": all(torch.equal(a, b) for a, b in grads),
            "grads_max_diff": max(float((a - b).abs().max()) for a, b in grads),
            "grads_nonzero": all(float(a.abs().sum()) > 0 for a, _ in grads),
            "returns": [s["out"] is not None for s in steps] + [evaluated is not None],
        }
        if last:
            found[label].update(
                losses=[s["losses"] for s in steps], ref_losses=ref_losses,
                out_equal=[torch.equal(s["out"], ref_out) for s in steps],
                eval_max_diff=float((evaluated - ref_eval).abs().max()),
                eval_losses=[l.item() for l in eval_losses],
            )
    return found


results = {json.dumps(c): run(*c) for c in CONFIGS}
gathered = [None] * W
dist.all_gather_object(gathered, results)
if rank == 0:
    print(RESULT + json.dumps(gathered), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

SERVED_LIBS = "{'backport': __import__('torch.distributed.pipelining', fromlist=['x'])}"
BOTH_LIBS = ("{'native': __import__('torch.distributed.pipelining', fromlist=['x']), "
             "'backport': __import__('torchpatch.patches.pipelining._runtime', fromlist=['x'])}")


def equality_run(tmp_path: Path, nproc: int, configs: list, libs: str, env: dict) -> List[dict]:
    script = EQUALITY.replace("LIBS_SOURCE", libs).replace("CONFIGS_SOURCE", repr(configs))
    proc = run_ranks(script, nproc=nproc, env=env, tmp_path=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return rank_result(proc)


def check_equal_to_one_process(ranks: List[dict], label: str, exact: bool) -> None:
    world = len(ranks)
    for config in ranks[0]:
        name, per_rank, n_mb, scale = json.loads(config)
        held = sorted(s for r in ranks for s in r[config][label]["stages"])
        assert held == list(range(world * per_rank)), (config, held)
        for rank, found in enumerate(ranks):
            got = found[config][label]
            assert got["grads_nonzero"], (config, rank)
            if exact:
                assert got["grads_equal"], (config, rank, got["grads_max_diff"])
            else:
                assert got["grads_max_diff"] <= 1e-6, (config, rank, got)
            is_last = (world * per_rank - 1) % world == rank
            assert got["returns"] == [is_last] * 3, (config, rank, got["returns"])
        last = ranks[(world * per_rank - 1) % world][config][label]
        assert len(last["ref_losses"]) == n_mb
        assert last["losses"] == [last["ref_losses"]] * 2, (config, last)
        assert last["out_equal"] == [True, True], config
        assert last["eval_max_diff"] <= 1e-6, config
        assert last["eval_losses"] == pytest.approx(last["ref_losses"], rel=1e-6, abs=1e-7), config


@only_torch(SERVED, "torch 2.1-2.3 have no torch.distributed.pipelining")
def test_native_module_not_found():
    proc = run_py("import torch.distributed.pipelining")
    assert "ModuleNotFoundError: No module named 'torch.distributed.pipelining'" in proc.stderr, proc.stderr[-2000:]


@only_torch(SERVED)
def test_served_modules_and_tracer_errors():
    out = run_json(
        """
        import json, torch, torchpatch
        import torch.distributed.pipelining as pp
        from torch.distributed.pipelining import microbatch, schedules, stage
        from torch.distributed.pipelining.schedules import get_schedule_class

        def outcome(fn, *args):
            try:
                fn(*args)
                return "no error"
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"

        print(json.dumps({
            "status": torchpatch.status().get("pipelining"),
            "all": sorted(pp.__all__),
            "submodules": [pp.schedules is schedules, pp.stage is stage, pp.microbatch is microbatch],
            "stage_is_one_class": stage.PipelineStage is pp.PipelineStage,
            "schedules": {n: get_schedule_class(n).__name__ for n in ("gpipe", "1F1B", "interleaved1f1b", "LoopedBFS",
                                                                      "PipelineScheduleSingle", "PipelineScheduleMulti")},
            "zbv": outcome(get_schedule_class, "ZBVZeroBubble"),
            "single_base": issubclass(schedules.Schedule1F1B, schedules.PipelineScheduleSingle),
            "multi_base": issubclass(schedules.ScheduleInterleaved1F1B, schedules.PipelineScheduleMulti),
            "pipeline": outcome(pp.pipeline, torch.nn.Linear(2, 2), (torch.ones(1, 2),)),
            "split_point": outcome(lambda: pp.SplitPoint.BEGINNING),
            "split_point_other": hasattr(pp.SplitPoint, "nothing"),
            "pipe_split": outcome(pp.pipe_split),
            "build_stage": outcome(pp.build_stage, torch.nn.Linear(2, 2), 0, None, "cpu"),
            "chunks": [t.tolist() for t in microbatch.split_args_kwargs_into_chunks(
                (torch.arange(6).view(6, 1),), {}, 3)[0][1][0]],
            "merged": microbatch.merge_chunks([torch.ones(2), torch.zeros(1)], None).tolist(),
            "spec": [str(s) for s in microbatch.TensorChunkSpec.from_tuple((0, 1))],
        }))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["status"] == "applied"
    assert out["all"] == sorted(["Pipe", "pipe_split", "SplitPoint", "pipeline", "PipelineStage", "build_stage",
                                 "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS"])
    assert out["submodules"] == [True, True, True] and out["stage_is_one_class"]
    assert out["schedules"] == {"gpipe": "ScheduleGPipe", "1F1B": "Schedule1F1B",
                                "interleaved1f1b": "ScheduleInterleaved1F1B", "LoopedBFS": "ScheduleLoopedBFS",
                                "PipelineScheduleSingle": "PipelineScheduleSingle",
                                "PipelineScheduleMulti": "PipelineScheduleMulti"}
    assert out["zbv"].startswith("ValueError: Schedule 'ZBVZeroBubble'") and "needs torch >= 2.6" in out["zbv"]
    assert out["single_base"] and out["multi_base"]
    for key, what in (("pipeline", "pipeline()"), ("split_point", "SplitPoint.BEGINNING"),
                      ("pipe_split", "pipe_split()"), ("build_stage", "build_stage()")):
        assert out[key].startswith(f"NotImplementedError: {what} splits a model by tracing it with torch.export"), out[key]
        assert "PipelineStage(submodule, stage_index, num_stages, device)" in out[key]
    assert out["split_point_other"] is False
    assert out["chunks"] == [[2], [3]] and out["merged"] == [1.0, 1.0, 0.0]
    assert out["spec"] == ["TensorChunkSpec(0)", "TensorChunkSpec(1)"]


@only_torch(SERVED)
@pytest.mark.parametrize("nproc, configs", [
    (2, [["GPipe", 1, 4, True], ["1F1B", 1, 4, True], ["Interleaved1F1B", 2, 4, True], ["LoopedBFS", 2, 2, True],
         ["1F1B", 1, 8, False]]),
    (4, [["GPipe", 1, 4, True], ["1F1B", 1, 8, True], ["Interleaved1F1B", 2, 8, True]]),
])
def test_pipeline_equals_one_process(tmp_path, nproc, configs):
    ranks = equality_run(tmp_path, nproc, configs, SERVED_LIBS, clean_env(TORCHPATCH="1"))
    schedules = {c: ranks[0][c]["backport"]["schedule"] for c in ranks[0]}
    assert sorted(set(schedules.values())) == sorted({f"Schedule{c[0]}" for c in configs})
    # Looped BFS runs the backwards in reverse microbatch order: the same sums in another order.
    for config in ranks[0]:
        exact = "LoopedBFS" not in config
        check_equal_to_one_process([{config: r[config]} for r in ranks], "backport", exact)


@only_torch(">=2.10", "the reference: torch's own pipelining with scale_grads and the relaxed Interleaved "
            "1F1B, working on gloo (torch 2.9.0's stage handshake sends int64 into a float32 receive, "
            "which gloo aborts on: pytorch/pytorch#165539, fixed after 2.9)")
def test_backport_agrees_with_native(tmp_path):
    configs = [["GPipe", 1, 4, True], ["1F1B", 1, 4, False], ["Interleaved1F1B", 2, 4, True]]
    ranks = equality_run(tmp_path, 2, configs, BOTH_LIBS, clean_env())
    check_equal_to_one_process(ranks, "backport", exact=True)
    check_equal_to_one_process(ranks, "native", exact=False)
    for config in ranks[0]:
        last = ranks[1][config]
        assert last["native"]["losses"] == last["backport"]["losses"], config


# Stage 1 of a GPipe raises in its forward of microbatch 1. MODE "exit": the exception, uncaught,
# ends that rank; "linger": that rank catches it and hangs on, so the others can only time out.
FAILING = """
import datetime, os, sys, time, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
rank, W = dist.get_rank(), dist.get_world_size()


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(4, 4), 0

    def forward(self, h):
        self.calls += 1
        if rank == 1 and self.calls == 2:
            raise ValueError("bad microbatch on stage 1")
        return torch.tanh(self.lin(h))


schedule = ScheduleGPipe(PipelineStage(Stage(), rank, W, torch.device("cpu")), n_microbatches=4, loss_fn=nn.MSELoss())
start = time.monotonic()
try:
    schedule.step(*([torch.randn(8, 4)] if rank == 0 else []), target=torch.randn(8, 4) if rank == W - 1 else None)
except Exception as exc:
    if rank == 1 and "MODE" == "exit":
        raise
    print(f"rank {rank} after {time.monotonic() - start:.1f}s: {type(exc).__name__}: {exc}", flush=True)
    if rank == 1:
        time.sleep(120)
    os._exit(1)
print(f"rank {rank} finished", flush=True)
os._exit(0)
"""


def start_ranks(script: Path, nproc: int, env: dict) -> List[subprocess.Popen]:
    """Each rank on its own, nothing kills the others when one fails (unlike torchrun)."""
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    return [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(nproc)]


@only_torch(SERVED)
@pytest.mark.parametrize("mode, nproc, pg_timeout", [("exit", 4, 60), ("linger", 2, 6)])
def test_exception_in_one_stage_ends_every_rank(tmp_path, mode, nproc, pg_timeout):
    script = tmp_path / "failing.py"
    script.write_text(FAILING.replace("TIMEOUT", str(pg_timeout)).replace('"MODE"', repr(mode)))
    procs = start_ranks(script, nproc, clean_env(TORCHPATCH="1"))
    start = time.monotonic()
    try:
        others = [p for r, p in enumerate(procs) if not (mode == "linger" and r == 1)]
        outputs = {}
        for r, p in enumerate(procs):
            if p in others:
                outputs[r] = p.communicate(timeout=90)[0]
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert all(p.returncode == 1 for p in others), {r: out[-1500:] for r, out in outputs.items()}
    assert "finished" not in "".join(outputs.values())
    if mode == "exit":
        assert ("RuntimeError: torchpatch pipelining: stage 1 (rank 1) failed in the forward of microbatch 1: "
                "ValueError: bad microbatch on stage 1") in outputs[1].splitlines()[-1]
    for r, out in outputs.items():
        if r == 1:
            continue
        line = next(ln for ln in out.splitlines() if ln.startswith(f"rank {r} after"))
        assert f"RuntimeError: torchpatch pipelining: stage {r} (rank {r}) could not receive the" in line, line
        assert "Another rank of the pipeline failed or stopped" in line
        waited = float(line.split(" after ")[1].split("s:")[0])
        if mode == "exit":
            assert waited < 30, line  # the failing rank's connection closed: no timeout needed
        else:
            assert "Timed out" in line and pg_timeout - 1 <= waited <= pg_timeout + 20, line
    assert elapsed < 90


@only_torch(">=2.4", "torch's own torch.distributed.pipelining")
def test_inactive_where_torch_has_it():
    out = run_json(
        """
        import json, torch, torchpatch
        import torch.distributed.pipelining as pp
        from torch.distributed.pipelining import schedules
        print(json.dumps({"file": pp.__file__, "stage": pp.PipelineStage.__module__,
                          "status": torchpatch.status().get("pipelining")}))
        """,
        env=clean_env(TORCHPATCH="1"),
    )
    assert out["file"].replace(os.sep, "/").endswith("torch/distributed/pipelining/__init__.py")
    assert out["stage"] == "torch.distributed.pipelining.stage"
    assert out["status"] is None

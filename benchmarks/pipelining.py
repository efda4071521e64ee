#!/usr/bin/env python3
"""The pipelining backport against torch's own ``torch.distributed.pipelining``: a benchmark
script that prints a throughput ratio, never a test.

Two ranks (gloo on loopback, one CPU thread each) run the same 2-stage GPipe workload, each rank one
stage of ``--layers`` ``Linear(hidden, hidden)`` + GELU blocks, ``--batch`` rows split into
``--microbatches``, MSE loss, ``zero_grad`` before every step. Side A is torch's ``PipelineStage``
and ``ScheduleGPipe``; side B the same classes of torchpatch's backport, loaded straight from
``patches/pipelining/_runtime/`` (no torchpatch install, no ``TORCHPATCH``), on the same torch.
Both start from the same parameters; one step of each is compared first (losses and gradients
must agree). Then ``--pairs`` rounds alternate the sides (A, B, then B, A, ...), each timing
``--steps`` steps between two barriers; the verdict is the throughput ratio B/A, the median wall
time of A over the median wall time of B, with the interquartile ranges and a 95% bootstrap interval
over the pairs. The same ratio of the two ranks' CPU time (less disturbed by other jobs on the
machine) is shown beside it. Target: >= 0.9. Exit status 0 when it is met.

    ~/.cache/torchpatch/nox/tests/bin/python benchmarks/pipelining.py            # torch 2.13.0
    python benchmarks/pipelining.py --python /path/to/venv/bin/python --pairs 31 --json

The interpreter (``--python``, default this one) needs torch >= 2.4 (native pipelining). torch 2.4.1's
own 1F1B hangs on gloo; GPipe is the workload here.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
RUNTIME = REPO / "src" / "torchpatch" / "patches" / "pipelining" / "_runtime"
RESULT = "PIPELINING-BENCH-RESULT "
TARGET = 0.9
WORKLOAD = ("pairs", "steps", "warmup", "hidden", "layers", "batch", "microbatches")  # passed to the ranks


def load_backport() -> Any:
    spec = importlib.util.spec_from_file_location("_pipelining_backport", RUNTIME / "__init__.py",
                                                  submodule_search_locations=[str(RUNTIME)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its modules import one another through the package
    spec.loader.exec_module(module)
    return module


def rank_main(opts: argparse.Namespace) -> None:
    """One rank: build both pipelines, check they agree, time them alternately."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import pipelining as native

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    backport = load_backport()
    torch.manual_seed(1000 + rank)
    module = nn.Sequential(*[m for _ in range(opts.layers) for m in (nn.Linear(opts.hidden, opts.hidden), nn.GELU())])
    torch.manual_seed(0)
    x, y = torch.randn(opts.batch, opts.hidden), torch.randn(opts.batch, opts.hidden)
    device = torch.device("cpu")
    sides = []
    for lib in (native, backport):
        submod = copy.deepcopy(module)
        stage = lib.PipelineStage(submod, rank, 2, device)
        sides.append((submod, lib.ScheduleGPipe(stage, n_microbatches=opts.microbatches, loss_fn=nn.MSELoss())))

    def run(side: int, steps: int) -> List[float]:
        submod, schedule = sides[side]
        losses: List[Any] = []
        for _ in range(steps):
            submod.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
        return [float(v) for v in losses]

    # Same workload: one step each from the same parameters gives the same losses and gradients.
    losses = [run(0, 1), run(1, 1)]
    grads = [[p.grad for p in side[0].parameters()] for side in sides]
    max_diff = max(float((a - b).abs().max()) for a, b in zip(*grads))
    for _ in range(opts.warmup):
        run(0, opts.steps)
        run(1, opts.steps)
    times: List[List[float]] = [[], []]
    cpu: List[List[float]] = [[], []]  # this rank's CPU seconds per run
    for i in range(opts.pairs):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            dist.barrier()
            start, cpu0 = time.perf_counter(), time.process_time()
            run(side, opts.steps)
            cpu[side].append(time.process_time() - cpu0)
            dist.barrier()
            times[side].append(time.perf_counter() - start)
    both: List[Any] = [None, None]
    dist.all_gather_object(both, cpu)
    if rank == 1:
        cpu_sum = [[a + b for a, b in zip(both[0][side], both[1][side])] for side in (0, 1)]
        print(RESULT + json.dumps({"torch": torch.__version__, "times": times, "cpu": cpu_sum, "losses": losses,
                                   "grad_max_abs_diff": max_diff}), flush=True)
    dist.barrier()
    os._exit(0)  # torch 2.4's gloo can hang in process-group teardown after P2P traffic


def iqr_pct(xs: Sequence[float]) -> float:
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 100.0 * (q3 - q1) / statistics.median(xs)


def ratio_of_medians(native: List[float], backport: List[float], opts: argparse.Namespace) -> Dict[str, Any]:
    """median(native) / median(backport), a 95% bootstrap interval over the pairs, ms per step, IQRs."""
    rng, n, boot = random.Random(12345), len(native), []
    for _ in range(2000):
        pick = rng.choices(range(n), k=n)
        boot.append(statistics.median([native[i] for i in pick]) / statistics.median([backport[i] for i in pick]))
    boot.sort()
    per_step = 1e3 / opts.steps
    return {
        "ratio": statistics.median(native) / statistics.median(backport), "ci95": [boot[50], boot[1949]],
        "ms_per_step": {"native": statistics.median(native) * per_step, "backport": statistics.median(backport) * per_step},
        "iqr_pct": {"native": iqr_pct(native), "backport": iqr_pct(backport)},
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch >= 2.4 (default: this one)")
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs of each side")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2, help="Linear+GELU blocks per stage")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts._rank:
        rank_main(opts)
        return 0
    sys.path.insert(0, str(REPO / "examples"))
    from launch import launch

    args = [f"--{name}={getattr(opts, name)}" for name in WORKLOAD]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHPATCH")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    ranks = launch(str(Path(__file__).resolve()), 2, ["--_rank", *args], env=env, timeout=1800, python=opts.python)
    line = next((ln for r in ranks for ln in (r.stdout or "").splitlines() if ln.startswith(RESULT)), None)
    if line is None or any(r.returncode for r in ranks):
        sys.exit("benchmark ranks failed:\n" + "\n".join((r.stderr or "")[-3000:] for r in ranks))
    data = json.loads(line[len(RESULT):])
    wall = ratio_of_medians(data["times"][0], data["times"][1], opts)
    result = {"throughput_ratio": wall["ratio"], "target": TARGET, "pass": wall["ratio"] >= TARGET,
              "pairs": opts.pairs, "steps_per_run": opts.steps, "wall": wall,
              "cpu": ratio_of_medians(data["cpu"][0], data["cpu"][1], opts), "torch": data["torch"],
              "grad_max_abs_diff": data["grad_max_abs_diff"], "same_losses": data["losses"][0] == data["losses"][1]}
    if opts.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"2-stage GPipe on torch {result['torch']}, 2 ranks (gloo), {opts.microbatches} microbatches of "
              f"{opts.batch // opts.microbatches} x {opts.hidden}, {result['pairs']} alternated pairs of {opts.steps} steps")
        for what, label in (("wall", "wall time"), ("cpu", "CPU time, both ranks")):
            r = result[what]
            ms, iqr, (lo, hi) = r["ms_per_step"], r["iqr_pct"], r["ci95"]
            print(f"  {label}: native {ms['native']:.3f} ms/step (IQR {iqr['native']:.1f}%), backport "
                  f"{ms['backport']:.3f} ms/step (IQR {iqr['backport']:.1f}%), native/backport {r['ratio']:.3f} "
                  f"[{lo:.3f}, {hi:.3f}]")
        print(f"  same first-step losses: {result['same_losses']}, max |grad difference| {result['grad_max_abs_diff']:.3g}")
        lo, hi = result["wall"]["ci95"]
        print(f"{'PASS' if result['pass'] else 'FAIL'}: throughput ratio backport/native {result['throughput_ratio']:.3f} "
              f"(95% bootstrap CI [{lo:.3f}, {hi:.3f}]), target >= {TARGET}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What torchpatch costs on DTensor's hot path: a benchmark script that prints ratios, never a test.

Each job is 2 ranks on gloo (CPU, one thread each), started fresh; jobs alternate their two sides
(``TORCHPATCH=1`` and the baseline, the first side alternating too) so that drift on the machine hits
both alike. Every figure is CPU time of the rank's main thread (``time.thread_time``: what dispatch
costs in Python, not waits for the peer), rank 0's, the median of blocks within a job; a side's
figure is the median over its jobs, and the verdict is on the ratio of the two medians. Each
measure also reports the spread of its jobs (IQR over median). Jobs run with address-space
randomization off (``setarch -R``, where it exists; ``--aslr`` keeps it): with it on, the CPU of one
DTensor op of the same job on this machine is about 42 us in most processes and about 77 us in
others (an A/A run, ``--on-env TORCHPATCH=0``, shows it), a 2x that no number of pairs resolves a
3% target through. Off, every process of a side has the same layout (so a layout that happens to
be slow for one side is a bias this cannot rule out). The ``calls`` counts below are exact.

1. ``ops``: one DTensor op at a time on a 1-D mesh of 2: ``add`` (Shard(0) + Shard(0)), ``sum``
   (to a Partial), ``mul_number`` (Shard(0) * 2.0), ``redistribute`` (Shard(0) -> Replicate(), an
   all-gather) and ``matmul`` (Shard(0) @ Replicate()). Target: ratio <= 1.03 each.
   Rank 1 blocks on the store while rank 0 times an op without communication.
2. ``steps``: a tensor-parallel MLP step (ColwiseParallel + RowwiseParallel, forward, backward,
   SGD) and an FSDP2 step (``fully_shard`` on the same MLP). Target: ratio <= 1.02 each. Where
   the step cannot run natively (FSDP2 on CPU on torch 2.4), the baseline is ``TORCHPATCH=1`` with
   only the patch the step needs (``TORCHPATCH_ENABLE``), and the line says so.
3. ``calls``: Python calls into torchpatch's code during one call of each op and one step of each (``sys.setprofile`` in
   rank 0, after warm-up), by function. Target: at most 5 per step.
4. ``--3d``: the cluster shape, 8 ranks on a 3-D mesh (dp_replicate 2 x dp_shard 2 x tp 2): an
   ``hsdp_tp_step``, the MLP tensor-parallel on ``tp`` then ``fully_shard`` (HSDP) on the 2-D
   ``(dp_replicate, dp_shard)`` mesh, forward, backward, SGD; its CPU ratio (target <= 1.02) and calls.
   With 8 ranks on fewer cores, rank 0's thread time still counts only its own work.
5. ``--in-process``: the jobs run with ``TORCHPATCH=1`` only, and each alternates its timed blocks
   between torchpatch installed and taken back (``torchpatch.uninstall()``, then ``install()``), after
   an untimed call each: the ratio is the median of the jobs' own ratios, free of the differences
   between processes (layout, placement) that dominate the spread of separate jobs on a shared
   machine. It measures what the patches cost per call, not what importing torchpatch changed;
   where a live object keeps a wrapper after ``uninstall()``, those calls are paid on both sides
   and listed. It also counts every Python call (any code's, builtins included) of one step on each
   side: deterministic, where the times of a shared machine are not.

    python benchmarks/dtensor_hot_path.py --python ~/.cache/torchpatch/nox/matrix-torch-2-9-0/bin/python
    python benchmarks/dtensor_hot_path.py --python PY --pairs 9 --json
    python benchmarks/dtensor_hot_path.py --python PY --3d --pairs 5
    python benchmarks/dtensor_hot_path.py --python PY --3d --calls-only     # one job, the exact counts
    python benchmarks/dtensor_hot_path.py --python PY --3d --in-process --pairs 9
    python benchmarks/dtensor_hot_path.py --device cuda --backend nccl --pairs 3   # one GPU: 1 rank

``--python`` is an interpreter with torch. torchpatch is the one installed there (the wheel: reinstall
it after changing the source); where none is (no start-up ``.pth``), or with ``--src``, the jobs run
this checkout's ``src/`` and activate it as ``torchpatch run`` does, with the start-up
``sitecustomize`` of ``src/torchpatch/_bootstrap`` first on ``PYTHONPATH``. ``--device cuda --backend
nccl`` runs every measure on ``--ranks`` ranks (default 1: one rank per GPU, the 3-D step on a
1 x 1 x 1 mesh). Each job checks that the ``TORCHPATCH=1`` side is active and the other is not.
Exit status 0 when every target is met.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

TARGETS = {"add": 1.03, "sum": 1.03, "mul_number": 1.03, "redistribute": 1.03, "matmul": 1.03,
           "tp_step": 1.02, "fsdp2_step": 1.02, "hsdp_tp_step": 1.02}
OPS = ("add", "sum", "mul_number", "redistribute", "matmul")
STEPS = ("tp_step", "fsdp2_step", "hsdp_tp_step")
CALLS_TARGET = 5  # per step
# Steps that cannot run natively on some torch, and the one patch they need there.
NEEDS = {"fsdp2_step": "fsdp2-cpu", "hsdp_tp_step": "fsdp2-cpu"}
SRC = Path(__file__).resolve().parent.parent / "src"


# -- the rank worker ---------------------------------------------------------------------------------

def _worker(config: Dict[str, Any]) -> None:
    import time

    import torch
    import torch.distributed as dist

    blocks, per_block, steps, count_calls = config["blocks"], config["per_block"], config["steps"], config["count_calls"]
    device = config["device"]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(config["backend"])
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # each rank on one CPU, the same one each job
    torch.set_default_device(device)
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.1-2.4 natively
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    a = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(32, 16), mesh, [Replicate()])
    def add() -> Any:
        return a + b

    def sum_() -> Any:
        return a.sum()

    def mul_number() -> Any:
        return a * 2.0

    def redistribute() -> Any:
        return a.redistribute(mesh, [Replicate()])

    def matmul() -> Any:
        return a @ w

    ops = {"add": add, "sum": sum_, "mul_number": mul_number, "redistribute": redistribute, "matmul": matmul}
    result: Dict[str, Any] = {"us": {}, "us_uninstalled": {}, "errors": {}, "calls": {}, "calls_uninstalled": {},
                              "python_calls": {}}

    store = dist.distributed_c10d._get_default_store()

    sides = (True, False) if config["in_process"] else (None,)

    def per_call(fn: Any, n: int, repeat: int, alone: bool = False) -> Dict[Any, float]:
        """Median CPU per call over ``repeat`` blocks of ``n``, by side: with ``in_process``, blocks
        with torchpatch installed (True) and uninstalled (False) alternate, the first side alternating
        too, each after an untimed call. ``alone`` (an op without communication): rank 1 blocks on the
        store meanwhile (gloo's barrier polls, and on a 2-vCPU machine the other vCPU may be this
        core's hyperthread), so rank 0 has the core to itself."""
        key = f"hot-path/{fn.__name__}/{n}"
        if alone and rank != 0:
            store.get(key)
            return {side: 0.0 for side in sides}
        for _ in range(max(5, n // 4)):  # warm-up: sharding caches filled
            fn()
        times: Dict[Any, List[float]] = {side: [] for side in sides}
        for block in range(repeat):
            for side in (sides if block % 2 == 0 else sides[::-1]):
                if side is not None:
                    _install(side)
                    fn()
                sync()  # a GPU's queue drained outside the timed block (a wait would count as CPU)
                if not alone:
                    dist.barrier()
                start = time.thread_time_ns()
                for _ in range(n):
                    fn()
                times[side].append((time.thread_time_ns() - start) / n / 1000)
        if sides[0] is not None:  # installed again, its caches refilled (the calls counted next)
            _install(True)
            fn()
        if alone:
            store.set(key, "done")
        return {side: statistics.median(values) for side, values in times.items()}

    for name, fn in ops.items():
        if name not in config["measures"]:
            continue
        _record(result, name, per_call(fn, per_block, blocks, alone=(name != "redistribute")))
        if count_calls and (rank == 0 or name == "redistribute"):  # a collective: both ranks
            result["calls"][name] = _calls_in(fn)

    makers = {"tp_step": _tp_step, "fsdp2_step": _fsdp2_step, "hsdp_tp_step": _hsdp_tp_step}
    for name, make in makers.items():
        if name not in config["measures"]:
            continue
        try:
            step = make(mesh)
            _record(result, name, per_call(step, 1, steps))
        except Exception as exc:  # noqa: BLE001 - reported, the other measurements stand
            result["errors"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            continue
        if count_calls:
            result["calls"][name] = _calls_in(step)
            if config["in_process"]:  # what uninstalling leaves behind (a wrapper a live object holds)
                on = _python_calls(step)
                _install(False)
                step()
                result["calls_uninstalled"][name] = _calls_in(step)
                result["python_calls"][name] = {"on": on, "uninstalled": _python_calls(step)}
                _install(True)
                step()
    dist.barrier()
    if rank == 0:
        import torchpatch  # importing it installs nothing: did TORCHPATCH (or its absence) hold?

        result["active"] = torchpatch.is_installed()
        result["failed"] = sorted(k for k, v in torchpatch.status().items() if v == "failed")
        print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # gloo's teardown can hang on some torches: leave deterministically


def _install(on: bool) -> None:
    """``--in-process``: torchpatch installed (as ``TORCHPATCH=1`` did) or taken back whole."""
    import torchpatch

    if on and not torchpatch.is_installed():
        torchpatch.install()
    elif not on:
        torchpatch.uninstall()


def _record(result: Dict[str, Any], name: str, by_side: Dict[Any, float]) -> None:
    result["us"][name] = by_side.get(True, by_side.get(None))
    if False in by_side:
        result["us_uninstalled"][name] = by_side[False]


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _train_step(model: Any, x: Any) -> Any:
    import torch

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def _tp_step(mesh: Any) -> Any:
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return _train_step(model, torch.randn(8, 64))


def _fully_shard() -> Any:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch 2.4-2.5
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _fsdp2_step(mesh: Any) -> Any:
    import torch

    fully_shard = _fully_shard()
    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train_step(model, torch.randn(8, 64))


def _hsdp_tp_step(mesh: Any) -> Any:
    """The cluster shape: a 3-D mesh (dp_replicate, dp_shard, tp) of 8 ranks (1 x 1 x 1 on one rank),
    the MLP tensor-parallel on ``tp``, then HSDP (``fully_shard`` on the 2-D data-parallel mesh)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = dist.get_world_size()
    if world not in (1, 8):
        raise ValueError(f"the 3-D step needs 8 ranks (2 x 2 x 2) or 1, not {world}")
    side = 2 if world == 8 else 1
    mesh_3d = init_device_mesh(mesh.device_type, (side, side, side), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    fully_shard = _fully_shard()
    model = parallelize_module(_mlp(), mesh_3d["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    dp_mesh = mesh_3d["dp_replicate", "dp_shard"]
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return _train_step(model, torch.randn(8, 64))


def _profiled(step: Any, count: Callable[[Any, str], None]) -> None:
    """One call of ``step`` with ``count(frame, event)`` called for each event the profiler sees."""
    sys.setprofile(lambda frame, event, arg: count(frame, event))
    try:
        step()
    finally:
        sys.setprofile(None)


def _calls_in(step: Any) -> Dict[str, int]:
    """Python calls into torchpatch's code during one call of ``step``, by function."""
    import torchpatch

    root = str(Path(torchpatch.__file__).resolve().parent)
    counts: Dict[str, int] = {}

    def count(frame: Any, event: str) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(root):
            key = f"{code.co_filename[len(root) + 1:]}:{code.co_name}"
            counts[key] = counts.get(key, 0) + 1

    _profiled(step, count)
    return counts


def _python_calls(step: Any) -> int:
    """Every call during one call of ``step`` that the profiler sees, any code's: Python functions and
    the builtins they call (what a patch adds to torch's own Python work, deterministically)."""
    calls = [0]

    def count(frame: Any, event: str) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    _profiled(step, count)
    return calls[0]


# -- the parent: alternated jobs -------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _base_env(args: argparse.Namespace) -> Dict[str, str]:
    """The environment of every job: none of the caller's TORCHPATCH* or PYTHON* settings but its
    PYTHONPATH, with this checkout's src/ and its start-up sitecustomize first where ``--src``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHPATCH", "PYTHON")) or k == "PYTHONPATH"}
    if args.src:
        paths = [str(SRC / "torchpatch" / "_bootstrap"), str(SRC)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _job(python: str, env_side: Dict[str, str], args: argparse.Namespace, count_calls: bool) -> Dict[str, Any]:
    env = _base_env(args)
    env.update(env_side, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(args.ranks),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TORCHPATCH_LOG="off")
    config = {"blocks": args.blocks, "per_block": args.per_block, "steps": args.steps, "count_calls": count_calls,
              "device": args.device, "backend": args.backend, "measures": args.measures,
              "in_process": args.in_process and env_side.get("TORCHPATCH") == "1"}
    command = [python, __file__, "--worker", json.dumps(config)]
    setarch = shutil.which("setarch")
    if setarch and not args.aslr:  # the same addresses in every process: see the module's docstring
        command = [setarch, platform.machine(), "-R", *command]
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(args.ranks)]
    try:
        outs = [p.communicate(timeout=args.timeout) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    line = next((l for l in outs[0][0].splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"rank 0 gave no result (exit {ranks[0].returncode}):\n{outs[0][1][-3000:]}")
    result = json.loads(line[len("RESULT "):])
    wanted = env_side.get("TORCHPATCH") == "1"
    if result["active"] != wanted:
        raise RuntimeError(f"torchpatch was {'not ' if wanted else ''}active in a job with TORCHPATCH="
                           f"{env_side.get('TORCHPATCH', '(unset)')}: is it installed in --python, or use --src")
    if result["failed"]:  # a patch that failed was taken back: the measure would not be torchpatch's cost
        raise RuntimeError(f"patches failed to apply: {', '.join(result['failed'])} (run with TORCHPATCH_LOG=warning)")
    return result


def _spread(values: List[float]) -> float:
    """Interquartile range over median: how far apart the jobs of one side are (a ratio closer to 1
    than this is not resolved by these jobs; an A/A run, ``--on-env TORCHPATCH=0``, shows it)."""
    if len(values) < 4:
        return (max(values) - min(values)) / statistics.median(values)
    q = statistics.quantiles(values, n=4)
    return (q[2] - q[0]) / statistics.median(values)


def _version(python: str) -> str:
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, env={**os.environ, "TORCHPATCH": "0"}).stdout.strip()


def _has_startup_hook(python: str) -> bool:
    """Whether torchpatch's start-up module is installed in ``python`` (the wheel's ``.pth``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    probe = "import importlib.util; print(importlib.util.find_spec('_torchpatch_startup') is not None)"
    return subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env).stdout.strip() == "True"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--python", default=sys.executable, help="interpreter with torch and torchpatch")
    parser.add_argument("--pairs", type=int, default=7, help="jobs per side (alternated), default 7")
    parser.add_argument("--blocks", type=int, default=9, help="timed blocks per op in a job")
    parser.add_argument("--per-block", type=int, default=200, help="op calls per block")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per job")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a job may take")
    parser.add_argument("--on-env", action="append", default=[], metavar="NAME=VALUE",
                        help="also set this in the TORCHPATCH=1 side, e.g. TORCHPATCH_DISABLE=funcol-autograd "
                             "to see what one patch costs (repeatable)")
    parser.add_argument("--aslr", action="store_true",
                        help="keep address-space randomization on in the jobs (default: off, through setarch -R)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--3d", dest="three_d", action="store_true",
                        help="the cluster shape: the HSDP + TP step on 8 ranks, mesh 2 x 2 x 2")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the tensors live")
    parser.add_argument("--backend", default="gloo", help="process group backend (nccl with --device cuda)")
    parser.add_argument("--ranks", type=int, default=None,
                        help="ranks per job (default: 8 with --3d, 1 with --device cuda, else 2)")
    parser.add_argument("--calls-only", action="store_true", help="only count the calls, in one TORCHPATCH=1 job")
    parser.add_argument("--in-process", action="store_true",
                        help="each job (TORCHPATCH=1) also times blocks with torchpatch uninstalled, alternated in "
                             "the same process: the ratio per job, without the differences between processes")
    parser.add_argument("--src", action="store_true",
                        help="run this checkout's src/ (the default where --python has no torchpatch installed)")
    args = parser.parse_args(argv)
    if args.ranks is None:
        args.ranks = 8 if args.three_d else 1 if args.device == "cuda" else 2
    args.measures = ["hsdp_tp_step"] if args.three_d else list(OPS + STEPS if args.ranks == 1 else OPS + STEPS[:2])
    args.src = args.src or not _has_startup_hook(args.python)
    if args.src:  # torchpatch's own dependencies, which an installed wheel would have brought
        missing = subprocess.run([args.python, "-c", "import wrapt, packaging"], capture_output=True, text=True)
        if missing.returncode:
            parser.error(f"--python lacks torchpatch's dependencies (pip install wrapt packaging): {missing.stderr[-200:]}")

    version = _version(args.python)
    on = {"TORCHPATCH": "1", **dict(item.split("=", 1) for item in args.on_env)}
    if args.calls_only:  # one TORCHPATCH=1 job, untimed: the exact counts
        args.blocks, args.per_block, args.steps = 1, 1, 1
        result = _job(args.python, on, args, count_calls=True)
        step_calls = {name: sum(counts.values()) for name, counts in result["calls"].items() if name in STEPS}
        print(json.dumps({"torch": version, "ranks": args.ranks, "calls": result["calls"], "step_calls": step_calls,
                          "errors": result["errors"]}, indent=None if not args.json else 1))
        return 0 if all(n <= CALLS_TARGET for n in step_calls.values()) else 1
    sides: Dict[str, List[Dict[str, Any]]] = {"on": [], "off": [], "needs": []}
    calls: Dict[str, Dict[str, int]] = {}
    for pair in range(args.pairs):
        if args.in_process:  # both sides in each job
            result = _job(args.python, on, args, count_calls=not calls)
            calls = calls or result["calls"]
            sides["on"].append(result)
            sides["off"].append({"us": result["us_uninstalled"], "errors": result["errors"]})
            continue
        order = [("on", on), ("off", {})] if pair % 2 == 0 else [("off", {}), ("on", on)]
        for side, env_side in order:
            result = _job(args.python, env_side, args, count_calls=(side == "on" and not calls))
            calls = calls or result["calls"]
            sides[side].append(result)
        needed = [NEEDS[s] for s in NEEDS if s in sides["off"][-1]["errors"] and s not in sides["on"][-1]["errors"]]
        if needed:  # a step that cannot run natively: a baseline with only the patch it needs
            sides["needs"].append(_job(args.python, {"TORCHPATCH": "1", "TORCHPATCH_ENABLE": ",".join(needed)},
                                       args, False))

    report: Dict[str, Any] = {"torch": version, "pairs": args.pairs, "ranks": args.ranks, "device": args.device,
                              "backend": args.backend, "src": args.src, "on": on, "measures": {}, "calls": calls}
    if args.in_process:
        report["calls_uninstalled"] = sides["on"][0]["calls_uninstalled"] if sides["on"] else {}
        report["python_calls"] = sides["on"][0]["python_calls"] if sides["on"] else {}
    met = True
    for name, target in TARGETS.items():
        if name not in args.measures:
            continue
        on_us = [r["us"][name] for r in sides["on"] if name in r["us"]]
        base, baseline = sides["off"], "TORCHPATCH unset"
        if not [r for r in base if name in r["us"]] and sides["needs"]:
            base, baseline = sides["needs"], f"TORCHPATCH=1 TORCHPATCH_ENABLE={NEEDS[name]}"
        off_us = [r["us"][name] for r in base if name in r["us"]]
        if not on_us or not off_us:
            errors = {r["errors"].get(name) for r in sides["on"] + base} - {None}
            report["measures"][name] = {"error": sorted(errors)}
            met = False
            continue
        ratio = statistics.median(on_us) / statistics.median(off_us)
        spread = max(_spread(on_us), _spread(off_us))
        if args.in_process:  # paired: the median of the jobs' own ratios, and their spread
            baseline = "uninstalled, alternated in the same process"
            ratios = [a / b for a, b in zip(on_us, off_us)]
            ratio, spread = statistics.median(ratios), _spread(ratios)
        met &= ratio <= target
        report["measures"][name] = {"on_us": round(statistics.median(on_us), 2),
                                    "off_us": round(statistics.median(off_us), 2), "ratio": round(ratio, 3),
                                    "target": target, "baseline": baseline, "spread": round(spread, 2),
                                    "on_jobs": [round(v, 1) for v in on_us], "off_jobs": [round(v, 1) for v in off_us]}
    step_calls = {name: sum(counts.values()) for name, counts in calls.items() if name in STEPS}
    report["step_calls"] = step_calls
    met &= all(n <= CALLS_TARGET for n in step_calls.values())
    report["met"] = met
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"torch {version}, {args.pairs} jobs a side of {args.ranks} rank(s) ({args.device}, {args.backend}"
              + (", torchpatch from src/" if args.src else "") + "), CPU of rank 0's main thread; on: "
              + " ".join(f"{k}={v}" for k, v in on.items()))
        for name, m in report["measures"].items():
            if "error" in m:
                print(f"  {name:14} cannot run: {'; '.join(m['error'])[:200]}")
            else:
                print(f"  {name:14} {m['on_us']:10.1f} us on  {m['off_us']:10.1f} us off ({m['baseline']})"
                      f"  ratio {m['ratio']:.3f}  target <= {m['target']}  (jobs' IQR {m['spread']:.0%} of the median)")
        for step, counts in calls.items():  # the ops, then the steps
            top = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])[:6])
            print(f"  calls into torchpatch per {step}: {sum(counts.values())}" + (f" ({top})" if top else ""))
        for step, counts in report.get("calls_uninstalled", {}).items():
            print(f"  calls into torchpatch per {step} after uninstall() (both sides pay them): {sum(counts.values())}")
        for step, n in report.get("python_calls", {}).items():
            print(f"  Python calls per {step}, any code's: {n['on']} installed, {n['uninstalled']} uninstalled "
                  f"({n['on'] / n['uninstalled']:.4f})")
        print("every target met" if met else "some target missed")
    return 0 if met else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())

#!/usr/bin/env python3
"""What the xla-parallelize patch costs: a benchmark script that prints ratios, never a test.

A 2-layer transformer (tiny: dim 32, 4 heads, vocab 64, batch 4 x 16 tokens) on torch_xla SPMD with
4 virtual CPU devices (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``, set here unless already set), in one
process with ``torchpatch.install()``. The two sides are the patch's rerouted
``parallelize_module(model, xla_mesh, plan)`` with a wildcard Colwise/Rowwise plan
(``"layers.*.attn.wq"``, ...) and the maintainers' recipe: ``distribute_tensor`` called by hand on
each of the same parameters with the same placements. Before timing, both sides must give every
parameter the same sharding spec (else exit 2).

1. ``parallelize``: one call of either side on a fresh copy of the model (copied and synced to the
   devices outside the timed region; ``xm.wait_device_ops()`` inside it). Target: ratio <= 1.1.
2. ``train-step``: forward, backward, SGD step, ``torch_xla.sync()`` and ``xm.wait_device_ops()``
   on the model each side made, after warm-up steps that compile the graph. Target: ratio <= 1.02.
   Whether both sides trace the same forward graph (HLO text) is printed with it.

Each measurement alternates its two sides (A B, B A, A B, ...) and reports the medians, the ratio of
the medians, the interquartile range as % of the median and a 95% bootstrap interval over the pairs
(``benchmarks/startup.py``'s statistics), for wall time (the verdict) and for the process's CPU time
(all threads; less disturbed by other jobs on the machine). Exit status 0 when both targets are met.

    PY benchmarks/xla_parallelize.py          # PY: a python with torch_xla and torchpatch installed
    PY benchmarks/xla_parallelize.py --parallelize-pairs 101 --step-pairs 501 --json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from startup import Result, report, summarize  # noqa: E402  (the same statistics)

DIM, HEADS, VOCAB, LAYERS, BATCH, SEQ = 32, 4, 64, 2, 4, 16


Timed = Callable[[], Tuple[float, float]]


def alternate(a: Timed, b: Timed, pairs: int) -> Tuple[List[float], List[float], List[float], List[float]]:
    """Wall and CPU seconds of ``pairs`` runs of each side, alternated A B, B A, A B, ... so that
    neither side always runs first."""
    wall: Tuple[List[float], List[float]] = ([], [])
    cpu: Tuple[List[float], List[float]] = ([], [])
    for i in range(pairs):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            w, c = (a, b)[side]()
            wall[side].append(w)
            cpu[side].append(c)
    return wall[0], wall[1], cpu[0], cpu[1]


def timed(fn: Callable[[], None]) -> Tuple[float, float]:
    """(wall, CPU) seconds of ``fn()``; CPU is the process's, all threads (XLA's included)."""
    cpu0, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu0


def build() -> Dict[str, Any]:
    """The model, the plan and the by-hand recipe; torch and torch_xla imported here."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch_xla.runtime as xr
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    xr.use_spmd()

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = (w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(att.transpose(1, 2).reshape(b, s, -1))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn_norm, self.ffn_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.attn = Attention()
            self.w1, self.w2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.attn_norm(x))
            return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))

    class Transformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.out = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.tok(ids)
            for layer in self.layers:
                x = layer(x)
            return self.out(x)

    mesh = init_device_mesh("xla", (xr.global_runtime_device_count(),))
    plan = {"tok": RowwiseParallel(), "layers.*.attn.w[qkv]": ColwiseParallel(),
            "layers.*.attn.wo": RowwiseParallel(), "layers.*.w1": ColwiseParallel(),
            "layers.*.w2": RowwiseParallel(), "out": ColwiseParallel()}

    def by_hand(model: Transformer) -> Transformer:
        distribute_tensor(model.tok.weight, mesh, [Shard(0)])
        for layer in model.layers:
            for w in (layer.attn.wq, layer.attn.wk, layer.attn.wv):
                distribute_tensor(w.weight, mesh, [Shard(0)])
            distribute_tensor(layer.attn.wo.weight, mesh, [Shard(1)])
            distribute_tensor(layer.w1.weight, mesh, [Shard(0)])
            distribute_tensor(layer.w1.bias, mesh, [Shard(0)])
            distribute_tensor(layer.w2.weight, mesh, [Shard(1)])
            distribute_tensor(layer.w2.bias, mesh, [Replicate()])
        distribute_tensor(model.out.weight, mesh, [Shard(0)])
        return model

    annotated = 2 + 8 * LAYERS  # the distribute_tensor calls above

    torch.manual_seed(0)
    return {"template": Transformer().to("xla"), "mesh": mesh, "plan": plan, "by_hand": by_hand,
            "ids": torch.randint(0, VOCAB, (BATCH, SEQ)).to("xla"), "annotated": annotated}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--parallelize-pairs", type=int, default=61)
    ap.add_argument("--step-pairs", type=int, default=301)
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded rounds of each side first")
    ap.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = ap.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "4")

    import torchpatch

    torchpatch.install()
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    from torch.distributed.tensor.parallel import parallelize_module

    if torchpatch.status().get("xla-parallelize") != "applied":
        sys.exit(f"the xla-parallelize patch is not applied: {torchpatch.status().get('xla-parallelize')}")
    b = build()
    template, mesh, plan, by_hand, ids = b["template"], b["mesh"], b["plan"], b["by_hand"], b["ids"]
    rerouted: Callable[[Any], Any] = lambda m: parallelize_module(m, mesh, plan)
    spec_of = torch_xla._XLAC._get_xla_sharding_spec

    def fresh() -> Any:
        model = copy.deepcopy(template)
        torch_xla.sync()
        xm.wait_device_ops()
        return model

    a_model, b_model = rerouted(fresh()), by_hand(fresh())
    specs = [{n: spec_of(p) for n, p in m.named_parameters()} for m in (a_model, b_model)]
    if specs[0] != specs[1] or specs[0] == {n: spec_of(p) for n, p in template.named_parameters()}:
        print(f"the two sides shard differently:\n{specs[0]}\n{specs[1]}", file=sys.stderr)
        return 2

    # The step graphs of the two sides, as XLA gets them (parameters are inputs, so equal text
    # means one compiled program): any difference in step time is then the machine's noise.
    hlo = [torch_xla._XLAC._get_xla_tensors_hlo([m(ids).float().pow(2).mean()]) for m in (a_model, b_model)]
    same_graph = hlo[0] == hlo[1]
    torch_xla.sync()

    def time_parallelize(side: Callable[[Any], Any]) -> Timed:
        def run() -> Tuple[float, float]:
            model = fresh()
            return timed(lambda: (side(model), xm.wait_device_ops()))
        return run

    def time_step(model: Any) -> Timed:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model(ids).float().pow(2).mean().backward()
            opt.step()
            torch_xla.sync()
            xm.wait_device_ops()
        return lambda: timed(step)

    labels = ("parallelize_module (rerouted)", "distribute_tensor by hand")
    results: List[Result] = []
    for name, target, pairs, sides, what in (
        ("parallelize", 1.1, args.parallelize_pairs, (time_parallelize(rerouted), time_parallelize(by_hand)),
         f"{b['annotated']} of {len(specs[0])} parameters annotated per call"),
        ("train-step", 1.02, args.step_pairs, (time_step(a_model), time_step(b_model)),
         f"forward+backward+SGD step, batch {BATCH}x{SEQ}, {LAYERS} layers, dim {DIM}; "
         f"{'the same' if same_graph else 'DIFFERENT'} forward graph on both sides"),
    ):
        alternate(*sides, pairs=args.warmup)
        xs, ys, cpu_xs, cpu_ys = alternate(*sides, pairs=pairs)
        results.append(dict(summarize(name, xs, ys, labels, "ms", 1e3, target, True), what=what,
                            cpu=summarize("cpu", cpu_xs, cpu_ys, labels, "ms", 1e3, target, True)))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, "
              f"{os.environ['CPU_NUM_DEVICES']} virtual {os.environ['PJRT_DEVICE']} devices (SPMD)")
        for r in results:
            report(r)
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""One rank of a ``tools/dtensor_fuzz.py`` job: runs programs ``PROGRAMS`` (their numbers,
comma-separated) of a seed, each on DTensors and on full tensors, and writes one JSON line per program
to ``OUT.0`` (a rank that finds its peer stuck writes ``hang`` to ``OUT.<rank>`` and leaves).

    RANK=r PORT=p python tools/dtensor_fuzz_worker.py SEED PROGRAMS OUT WAIT_S

After each program both ranks meet in the TCP store (not in a collective): each posts its outcome and
waits for the other's. A program that raises on one rank only leaves the other inside a collective;
its peer's wait runs out (``WAIT_S``), it writes ``hang`` and exits, which ends the stuck rank's
collective. A program that fails with different exception types on the two ranks, or fails on one
and not the other, ends the job too (a collective may be left pending): the driver starts the next
job after it.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dtensor_fuzz_programs import apply_op, draw, full_values  # noqa: E402

try:
    import torch.distributed.tensor as _dt

    if not hasattr(_dt, "Partial"):
        raise ImportError("torch.distributed.tensor has no Partial (torch < 2.5)")
except ImportError:
    import torch.distributed._tensor as _dt
from torch.distributed._tensor.placement_types import Partial, Replicate, Shard  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh  # noqa: E402

DTensor, distribute_tensor = _dt.DTensor, _dt.distribute_tensor
F64 = torch.float64
TOL = 1e-9


class Program:
    """One drawn program on this rank: its DTensor run and its full-tensor reference."""

    def __init__(self, spec: Dict[str, Any], meshes: Dict[str, Any], rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.mesh = meshes[str(spec["mesh"])]
        self.rng = random.Random(spec["values"])

    def tensor(self, shape: Sequence[int], low: float = -3.0, high: float = 3.0) -> torch.Tensor:
        return torch.tensor(full_values(self.rng, shape, low, high), dtype=F64).reshape(list(shape))

    def placements(self, spec: Sequence[Sequence[Any]]) -> List[Any]:
        return [Replicate() if p[0] == "R" else Shard(p[1]) if p[0] == "S" else Partial(p[1]) for p in spec]

    def dtensor(self, full: torch.Tensor, spec: Sequence[Sequence[Any]]) -> Any:
        """``full`` laid out as ``spec`` says; a Partial's pieces reduce to ``full`` (noise drawn here)."""
        noise = self.tensor(full.shape)
        plain = [Replicate() if p[0] == "P" else pl for p, pl in zip(spec, self.placements(spec))]
        laid_out = distribute_tensor(full, self.mesh, plain)
        if all(p[0] != "P" for p in spec):
            return laid_out
        local = laid_out.to_local()
        for dim, p in enumerate(spec):
            if p[0] == "P" and self.spec["mesh"][dim] == 2:
                local = _piece(local, p[1], self.mesh.get_coordinate()[dim], noise)
        return DTensor.from_local(local, self.mesh, self.placements(spec), run_check=False,
                                  shape=full.shape, stride=full.stride())

    def run(self, distributed: bool) -> List[torch.Tensor]:
        return getattr(self, "run_" + self.spec["kind"])(distributed)

    def run_ops(self, distributed: bool) -> List[torch.Tensor]:
        fulls = [self.tensor(self.spec["shape"]), self.tensor(self.spec["shape"], 0.5, 3.0)]
        if distributed:
            x, y = (self.dtensor(f, s) for f, s in zip(fulls, self.spec["inputs"]))
            number = lambda a: distribute_tensor(torch.tensor(a, dtype=F64), self.mesh, [Replicate()] * self.mesh.ndim)  # noqa: E731
        else:
            x, y = fulls
            number = lambda a: torch.tensor(a, dtype=F64)  # noqa: E731
        for op in self.spec["ops"]:
            x = apply_op(torch, op, x, y, number)
        return [x]

    def run_optim(self, distributed: bool) -> List[torch.Tensor]:
        shape = self.spec["shape"]
        full, grads = self.tensor(shape), [self.tensor(shape) for _ in range(2)]
        param = torch.nn.Parameter(distribute_tensor(full, self.mesh, self.placements(self.spec["param"]))
                                   if distributed else full.clone())
        opt = _optimizer(self.spec, [param])
        for g in grads:
            param.grad = self.dtensor(g, self.spec["grad"]) if distributed else g
            opt.step()
        return [param.detach()]

    def run_clip(self, distributed: bool) -> List[torch.Tensor]:
        grads = [self.tensor(s) for s in self.spec["shapes"]]
        norm_type = math.inf if self.spec["norm_type"] == "inf" else self.spec["norm_type"]
        true_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]), ord=norm_type)
        params = []
        for g, spec in zip(grads, self.spec["grads"]):
            if distributed:
                plain = [["R"] if p[0] == "P" else p for p in spec]
                p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), self.mesh, self.placements(plain)))
                p.grad = self.dtensor(g, spec)
            else:
                p = torch.nn.Parameter(torch.zeros_like(g))
                p.grad = g.clone()
            params.append(p)
        total = torch.nn.utils.clip_grad_norm_(params, float(true_norm) * self.spec["max_norm_ratio"],
                                               norm_type=norm_type, foreach=self.spec["foreach"])
        return [total] + [p.grad for p in params]

    def run_tp_mlp(self, distributed: bool) -> List[torch.Tensor]:
        din, hidden, batch = self.spec["dims"]
        model = torch.nn.Sequential(torch.nn.Linear(din, hidden, bias=self.spec["bias"], dtype=F64), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, din, bias=self.spec["bias"], dtype=F64))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(self.tensor(p.shape, -1.0, 1.0))
        x = self.tensor([batch, din])
        if distributed:
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(model, self.mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        out = model(x)
        loss = (out * out).sum()
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        _optimizer(self.spec, list(model.parameters())).step()
        return [loss] + grads + [p.detach() for p in model.parameters()]

    def run_norm_layer(self, distributed: bool) -> List[torch.Tensor]:
        batch, seq, dim = self.spec["dims"]
        seq *= 2  # even: SequenceParallel takes each rank's input as its shard
        layer = getattr(torch.nn, self.spec["layer"])(dim, dtype=F64)
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(self.tensor(p.shape))
        x, weights = self.tensor([batch, seq, dim]), self.tensor([batch, seq, dim])
        if distributed:
            from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

            parallelize_module(layer, self.mesh, SequenceParallel())
            x = x.chunk(2, dim=1)[self.rank]
        out = layer(x)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        (out * weights).sum().backward()
        return [out.detach()] + [p.grad for p in layer.parameters()]

    def run_loss_parallel(self, distributed: bool) -> List[torch.Tensor]:
        batch, vocab = self.spec["dims"]
        logits = self.tensor([batch, vocab])
        target = torch.tensor([self.rng.randrange(vocab) for _ in range(batch)])
        if distributed:
            from torch.distributed.tensor.parallel import loss_parallel

            x = distribute_tensor(logits, self.mesh, [Shard(1)]).requires_grad_(True)
            with loss_parallel():
                loss = torch.nn.functional.cross_entropy(x, target)
                loss.backward()
        else:
            x = logits.clone().requires_grad_(True)
            loss = torch.nn.functional.cross_entropy(x, target)
            loss.backward()
        return [loss.detach(), x.grad]


def _piece(local: torch.Tensor, kind: str, coordinate: int, noise: torch.Tensor) -> torch.Tensor:
    """This rank's part of a Partial(``kind``) whose reduction over 2 ranks is ``local``."""
    if kind == "sum":
        return local - noise if coordinate == 0 else noise.clone()
    if kind == "avg":
        return local + noise if coordinate == 0 else local - noise
    mine = (noise > 0) == (coordinate == 0)
    other = local - noise.abs() - 0.5 if kind == "max" else local + noise.abs() + 0.5
    return torch.where(mine, local, other)


def _optimizer(spec: Dict[str, Any], params: List[Any]) -> Any:
    if spec["optimizer"] == "AdamW":
        return torch.optim.AdamW(params, lr=0.1, weight_decay=0.1, foreach=spec["foreach"])
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=spec["foreach"])


def _full(t: Any) -> torch.Tensor:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return torch.as_tensor(t).detach()


def outcome(spec: Dict[str, Any], meshes: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """``right``/``wrong`` (against the full tensors), ``error`` (this rank's), or ``invalid``."""
    try:
        reference = [torch.as_tensor(t).detach() for t in Program(spec, meshes, rank).run(False)]
    except Exception as e:  # the program itself is invalid (both ranks see the same)
        return {"kind": "invalid", "err": _words(e)}
    try:
        got = [_full(t) for t in Program(spec, meshes, rank).run(True)]
    except Exception as e:
        return {"kind": "error", "err": _words(e)}
    same = len(got) == len(reference) and all(_same(g, r) for g, r in zip(got, reference))
    return {"kind": "right" if same else "wrong"}


def _same(got: torch.Tensor, ref: torch.Tensor) -> bool:
    if got.shape != ref.shape or got.dtype.is_floating_point != ref.dtype.is_floating_point:
        return False
    return bool(torch.allclose(got.double(), ref.double(), rtol=TOL, atol=TOL, equal_nan=True))


def _words(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def main(seed: int, programs: List[int], out: str, wait_s: float) -> None:
    rank, port = int(os.environ["RANK"]), int(os.environ["PORT"])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    meshes = {str(s): DeviceMesh("cpu", torch.arange(2).reshape(s)) for s in ([2], [2, 1], [1, 2])}
    with open(f"{out}.{rank}", "a") as f:
        for i in programs:
            mine = outcome(draw(seed, i), meshes, rank)
            store.set(f"{i}/{rank}", json.dumps(mine))
            try:
                store.wait([f"{i}/{1 - rank}"], timedelta(seconds=wait_s))
            except Exception:
                f.write(json.dumps({"i": i, "kind": "hang", "err": mine.get("err", mine["kind"])}) + "\n")
                f.flush()
                os._exit(3)
            theirs = json.loads(store.get(f"{i}/{1 - rank}"))
            both = _combine(mine, theirs)
            if rank == 0:
                f.write(json.dumps(dict(i=i, **both)) + "\n")
                f.flush()
            if both["kind"] == "split" or (both["kind"] == "error" and _type(mine) != _type(theirs)):
                _leave(store, rank, 4)
    _leave(store, rank, 0)


def _combine(mine: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, Any]:
    kinds = {mine["kind"], theirs["kind"]}
    if kinds <= {"right", "wrong"}:
        return {"kind": "wrong" if "wrong" in kinds else "right"}
    if kinds == {"error"} or kinds == {"invalid"}:
        return mine
    return {"kind": "split", "err": mine.get("err") or theirs.get("err")}


def _type(outcome: Dict[str, Any]) -> str:
    return outcome["err"].split(":", 1)[0]


def _leave(store: Any, rank: int, code: int) -> None:
    """Both ranks leave through the store (rank 0 hosts it, so it goes last), without gloo's teardown."""
    store.set(f"bye/{rank}", "1")
    if rank == 0:
        try:
            store.wait(["bye/1"], timedelta(seconds=30))
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(i) for i in sys.argv[2].split(",")], sys.argv[3], float(sys.argv[4]))

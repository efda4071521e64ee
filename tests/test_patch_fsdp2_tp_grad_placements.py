"""fsdp2-tp-grad-placements: FSDP2 over a 2 x 2 (data-parallel x tensor-parallel) mesh on 4 gloo ranks.

A small float64 LM whose token and position embeddings are TP'd as torchtitan's are
(``RowwiseParallel(input_layouts=Replicate())``: a ``Shard(0)`` weight whose gradient autograd hands back
``Replicate()`` on torch 2.4), beside a colwise and a rowwise linear (gradients placed as their weights)
and a layer norm FSDP shards alone, with ``fully_shard`` over the data-parallel dim (10 vocabulary rows
and 6 positions: uneven shards). Every rank's gradient shard of every parameter is compared with the
slice of the gradient one process computes over the global batch (the TP shard of that gradient, then
its FSDP shard), in the same run; the weights are deterministic (no RNG), so torch 2.15.0 natively
computes the same shards (compared too).

On torch 2.4 with the patch switched off (``TORCHPATCH=1``: torch 2.4's FSDP2 needs ``fsdp2-cpu`` on
a CPU, so "natively" means the rest of the catalogue on) the two embeddings' gradient shards hold
another rank's rows (data-parallel rank 1 of TP rank 0 reads rows of TP rank 1's shard), silently; with
it every shard equals one process's. Torch 2.6+ redistributes to the parameter's placements itself.
"""

import pytest

from conftest import (
    clean_env, gathered_tail, newest_torch_ranks_result, only_torch, ranks_result, where_patch_applies
)

PATCH_ID = "fsdp2-tp-grad-placements"
ENV_OFF = "TORCHPATCH_FSDP2_TP_GRAD_PLACEMENTS"

RANKS = """
import copy, datetime, json, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
try:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 without torchpatch (FSDP2 then cannot run on a CPU at all)
    from torch.distributed._tensor import DTensor, Replicate
    from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
V, S, D, B = 10, 6, 8, 4  # 10 and 6 rows: TP 5 and 3, then FSDP 3 + 2 and 2 + 1 (uneven)

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(S, D)
        self.norm, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, V, bias=False)

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1])).unsqueeze(0)
        return self.down(torch.tanh(self.up(self.norm(h))))

ref = LM().double()
with torch.no_grad():  # deterministic weights and batch, the same on every torch
    for k, p in enumerate(ref.parameters()):
        p.copy_(torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + k).reshape(p.shape))
ids = (torch.arange(B * S) * 7 % V).reshape(B, S)
targets = (torch.arange(B * S) * 5 % V).reshape(B, S)
model = copy.deepcopy(ref)
F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten()).backward()  # one process, the global batch

parallelize_module(model, mesh["tp"], {
    "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "up": ColwiseParallel(), "down": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
dp_rank, n = mesh.get_local_rank(0), B // 2
F.cross_entropy(model(ids[dp_rank * n:(dp_rank + 1) * n]).flatten(0, 1),
                targets[dp_rank * n:(dp_rank + 1) * n].flatten()).backward()

out = {"rel": {}, "shards": {}}
expected_of = dict(ref.named_parameters())
for name, param in model.named_parameters():
    grad, expected = param.grad, expected_of[name].grad
    coordinate, names = grad.device_mesh.get_coordinate(), grad.device_mesh.mesh_dim_names
    # TP shards first, FSDP shards TP's shard (however the mesh orders its dims: fsdp2-2d-state-dict labels
    # these parameters on the (tp, dp) mesh on torch 2.4)
    for dim in sorted(range(grad.device_mesh.ndim), key=lambda d: names[d] != "tp"):
        shard_dim = getattr(grad.placements[dim], "dim", None)  # Shard, and torch 2.5+'s _StridedShard
        if shard_dim is not None:
            expected = torch.chunk(expected, grad.device_mesh.size(dim), dim=shard_dim)[coordinate[dim]]
    local = grad.to_local()
    assert local.shape == expected.shape, (name, local.shape, expected.shape)
    out["rel"][name] = float((local - expected).abs().max() / expected.abs().max())
    out["shards"][name] = local.tolist()
"""


def _run(tmp_path, **env):
    return ranks_result(RANKS + gathered_tail(PATCH_ID), nproc=4, tmp_path=tmp_path,
                        env=clean_env(TORCHPATCH="1", **env))


def _worst(ranks):
    return {name: max(r["rel"][name] for r in ranks) for name in ranks[0]["rel"]}


@where_patch_applies(PATCH_ID)
def test_embedding_gradients_wrong_without_the_patch(tmp_path):
    """torch 2.4's FSDP2 reduce-scatters the embeddings' replicated gradients as TP shards: wrong rows."""
    ranks = _run(tmp_path, **{ENV_OFF: "0"})
    worst = _worst(ranks)
    assert ranks[0]["status"] != "applied"
    assert worst["tok.weight"] > 0.1 and worst["pos.weight"] > 0.1, worst
    # the gradients placed as their parameters are right: only the mismatched placements go wrong
    assert all(v < 1e-12 for name, v in worst.items() if not name.endswith(("tok.weight", "pos.weight"))), worst


@where_patch_applies(PATCH_ID)
def test_every_gradient_equals_one_process(tmp_path):
    ranks = _run(tmp_path)
    assert ranks[0]["status"] == "applied"
    worst = _worst(ranks)
    assert max(worst.values()) < 1e-12, worst
    # and torch 2.15.0 natively computes the same shards on every rank
    newest = newest_torch_ranks_result(RANKS + gathered_tail(PATCH_ID), nproc=4, tmp_path=tmp_path)
    assert max(_worst(newest).values()) < 1e-12
    for mine, theirs in zip(ranks, newest):
        for name, shard in mine["shards"].items():
            a, b = _flat(shard), _flat(theirs["shards"][name])
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-12, name


@only_torch(">=2.6", "torch that redistributes a gradient to its parameter's placements itself")
def test_newer_torch_needs_no_patch(tmp_path):
    ranks = _run(tmp_path)
    assert ranks[0]["status"] != "applied"
    assert max(_worst(ranks).values()) < 1e-12


def _flat(value):
    return [x for item in value for x in _flat(item)] if isinstance(value, list) else [value]

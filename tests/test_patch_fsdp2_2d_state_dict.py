"""fsdp2-2d-state-dict: FSDP2 + TP's state dict and DCP on torch 2.4, 4 gloo ranks on a 2 x 2 (dp, tp) mesh.

A small float64 LM (an embedding ``RowwiseParallel``, a colwise and a rowwise linear) with deterministic
weights, 10 rows over TP 2 then FSDP 2 (5 -> 3 + 2: uneven), ``fully_shard`` over the data-parallel dim.
Each rank checks, against the same model on one process: every parameter's ``full_tensor()``; a DCP
checkpoint of ``get_model_state_dict`` loaded into another 2-D model (round trip), a checkpoint of the
plain model (what a seed checkpoint is) loaded into a 2-D model, the 2-D checkpoint loaded by rank 0 into
a plain model; one AdamW step, then model and optimizer states saved and loaded into a third 2-D model
(every parameter and ``exp_avg``/``exp_avg_sq`` bitwise). Torch 2.15.0 natively, one process, loads the 2-D
checkpoint 2.4 saved into the plain model bitwise (the offsets DCP recorded are the real ones).

On torch >= 2.5 (no patch) the same checks pass natively with even shards; torch 2.9.0's ``full_tensor()``
of an unevenly sharded 2-D parameter is wrong (measured; 2.15.0's is right), not served here.

Natively (TORCHPATCH=1 with the patch off: torch 2.4's FSDP2 needs the catalogue on a CPU) ``full_tensor()``
returns wrong rows, silently, and the state dict raises ``NotImplementedError: 2D state_dict is under
development``.
"""

from conftest import clean_env, gathered_tail, only_torch, ranks_result, run_newest_torch_json, where_patch_applies

PATCH_ID = "fsdp2-2d-state-dict"
ENV_OFF = "TORCHPATCH_FSDP2_2D_STATE_DICT"

MODEL = """
import os, torch, torch.nn as nn
V, S, D = int(os.environ.get("LM_ROWS", "10")), 4, 6

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.up, self.down = nn.Embedding(V, D), nn.Linear(D, 2 * D), nn.Linear(2 * D, V, bias=False)

    def forward(self, ids):
        return self.down(torch.tanh(self.up(self.tok(ids))))

def make(offset):
    m = LM().double()
    with torch.no_grad():
        for k, p in enumerate(m.parameters()):
            p.copy_(torch.sin(torch.arange(p.numel(), dtype=torch.float64) * 0.37 + k + offset).reshape(p.shape))
    return m
"""

# a rank program's middle: model a's state dict, saved in FOLDER, loaded into a model MAKE(1) (round_trip), a seed
# checkpoint of the plain model into another (from_plain), FOLDER into the plain model on rank 0 (to_plain)
STATE_DICT_ROUND_TRIPS = """
    if rank == 0:  # a seed checkpoint: the plain model's state dict
        dcp.save(make(5).state_dict(), checkpoint_id=f"{root}/plain", process_group=solo)
    dist.barrier()
    b = MAKE(1)
    state = get_model_state_dict(b)
    dcp.load(state, checkpoint_id=f"{root}/FOLDER")
    set_model_state_dict(b, state)
    out["round_trip"] = equals(b, ref)
    c = MAKE(1)
    state = get_model_state_dict(c)
    dcp.load(state, checkpoint_id=f"{root}/plain")
    set_model_state_dict(c, state)
    out["from_plain"] = equals(c, make(5))
    if rank == 0:
        plain = make(3)
        state = plain.state_dict()
        _load_state_dict(state, dcp.FileSystemReader(f"{root}/FOLDER"), no_dist=True)
        plain.load_state_dict(state)
        out["to_plain"] = all(torch.equal(x, y) for x, y in zip(plain.parameters(), ref.parameters()))
"""

# a rank program's tail: a model MAKE(2) loads the optimizer state model b saved; the same state, bitwise
OPTIMIZER_ROUND_TRIP = """
    e = MAKE(2)
    opt2 = torch.optim.AdamW(e.parameters(), lr=0.1, foreach=True)
    step(e, opt2, *BATCH)
    state = {"model": get_model_state_dict(e), "optim": get_optimizer_state_dict(e, opt2)}
    dcp.load(state, checkpoint_id=f"{root}/opt")
    set_model_state_dict(e, state["model"])
    set_optimizer_state_dict(e, opt2, state["optim"])
    same = True
    for p1, p2 in zip(b.parameters(), e.parameters()):
        same &= torch.equal(p1.full_tensor(), p2.full_tensor())
        for key in ("exp_avg", "exp_avg_sq"):
            same &= torch.equal(opt.state[p1][key].full_tensor(), opt2.state[p2][key].full_tensor())
    out["optimizer_round_trip"] = bool(same)
"""

# the imports of a rank program, torch 2.4 without torchpatch included (test_patch_fsdp2_hsdp_tp too)
RANKS_IMPORTS = """
import datetime, json, os, sys, torch.nn.functional as F, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
try:
    from torch.distributed.tensor import Replicate
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 without torchpatch
    from torch.distributed._tensor import Replicate
    from torch.distributed._composable.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
"""

RANKS = MODEL + RANKS_IMPORTS + """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, root = dist.get_rank(), os.environ["CKPT_DIR"]
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
solo = dist.new_group([0])

def sharded(offset):
    m = make(offset)
    parallelize_module(m, mesh["tp"], {"tok": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(),
                                       "down": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    return m

def equals(m, reference):
    expected = dict(reference.named_parameters())
    return all(torch.equal(p.full_tensor(), expected[n]) for n, p in m.named_parameters())

out = {}
ref, a = make(0), sharded(0)
out["full_tensor"] = equals(a, ref)
try:
    dcp.save(get_model_state_dict(a), checkpoint_id=f"{root}/2d")
except NotImplementedError as exc:
    out["error"] = str(exc)
if "error" not in out:
""" + STATE_DICT_ROUND_TRIPS.replace("MAKE", "sharded").replace("FOLDER", "2d") + """
    ids = (torch.arange(8) * 7 % V).reshape(2, 4)

    def step(m, opt):
        F.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()

    opt = torch.optim.AdamW(b.parameters(), lr=0.1, foreach=True)
    step(b, opt)
    dcp.save({"model": get_model_state_dict(b), "optim": get_optimizer_state_dict(b, opt)}, checkpoint_id=f"{root}/opt")
""" + OPTIMIZER_ROUND_TRIP.replace("MAKE", "sharded").replace(", *BATCH", "")

NEWEST_READS_TEMPLATE = MODEL + """
import json, sys
import torch.distributed.checkpoint as dcp
ref, plain = make(0), make(3)
state = plain.state_dict()
dcp.load(state, checkpoint_id=sys.argv[1] + "/FOLDER")
plain.load_state_dict(state)
print(json.dumps(all(torch.equal(x, y) for x, y in zip(plain.parameters(), ref.parameters()))))
"""
NEWEST_READS = NEWEST_READS_TEMPLATE.replace("FOLDER", "2d")

CHECKS = ("full_tensor", "round_trip", "from_plain", "optimizer_round_trip")


def _ranks(tmp_path, **env):
    return ranks_result(RANKS + gathered_tail(PATCH_ID), nproc=4, tmp_path=tmp_path,
                        env=clean_env(TORCHPATCH="1", CKPT_DIR=str(tmp_path / "ckpt"), **env))


@where_patch_applies(PATCH_ID)
def test_native_full_tensor_wrong_and_state_dict_refused(tmp_path):
    """Torch 2.4 natively: ``full_tensor()`` of a 2-D parameter silently returns other rows than the
    parameter's (the label's order, not the layout's), and the state dict raises."""
    ranks = _ranks(tmp_path, **{ENV_OFF: "0"})
    assert all(r["full_tensor"] is False for r in ranks), ranks
    assert all("2D state_dict is under development" in r.get("error", "") for r in ranks), ranks
    assert ranks[0]["status"] != "applied"


@where_patch_applies(PATCH_ID)
def test_state_dict_and_dcp_equal_one_process(tmp_path):
    ranks = _ranks(tmp_path)
    assert ranks[0]["status"] == "applied"
    assert all(r.get(check) is True for r in ranks for check in CHECKS), ranks
    assert ranks[0]["to_plain"] is True
    # the newest torch reads what torch 2.4 saved, each shard where it belongs
    assert run_newest_torch_json(NEWEST_READS, str(tmp_path / "ckpt")) is True


@only_torch(">=2.5", "torch with the 2-D state dict")
def test_newer_torch_needs_no_patch(tmp_path):
    # even shards (12 rows: 6, then 3 + 3): torch 2.9's full_tensor() of an uneven _StridedShard parameter
    # (10 rows) returns wrong rows (2.15.0 does not), which is not this patch's
    ranks = _ranks(tmp_path, LM_ROWS="12")
    assert ranks[0]["status"] != "applied"
    assert all(r.get(check) is True for r in ranks for check in CHECKS), ranks

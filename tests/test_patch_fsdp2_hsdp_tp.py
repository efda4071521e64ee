"""fsdp2-hsdp-tp: HSDP + TP with FSDP2 on torch 2.4, 8 gloo ranks on a 2 x 2 x 2 (dp_replicate, dp_shard, tp)
mesh.

A small float64 LM (an embedding ``RowwiseParallel``, a colwise and a rowwise linear) with deterministic
weights, 10 rows over TP 2 then FSDP 2 (5 -> 3 + 2: uneven), ``fully_shard`` over the (dp_replicate,
dp_shard) mesh. Each rank checks, against the same model on one process in the same run: every parameter's
``full_tensor()``; its gradients after one step on the global batch (each data-parallel rank a quarter of
it; float64, to 1e-12: the data-parallel sums run in another order; tests/test_cluster_shapes.py compares
bit for bit on values whose sums are exact) and its weights after one AdamW step; a DCP checkpoint of
``get_model_state_dict`` loaded into another HSDP + TP model, a plain model's checkpoint (a seed checkpoint)
loaded into one, and the HSDP + TP checkpoint loaded by rank 0 into a plain model; model and optimizer states
after the step saved and loaded into a third model (every parameter and ``exp_avg``/``exp_avg_sq`` bitwise).
Torch 2.15.0 natively, one process, reads the checkpoint 2.4 saved into the plain model bitwise.

With the patch switched off (``TORCHPATCH=1``: torch 2.4's FSDP2 needs the catalogue on a CPU) ``fully_shard``
raises torch's own ``NotImplementedError: Using TP with HSDP is not supported``. On torch 2.9.0 and 2.13.0
the patch stays inactive and torch passes the same checks natively (even shards, 12 rows: 2.9.0's
``full_tensor()`` of an unevenly sharded ``_StridedShard`` parameter is wrong, see
test_patch_fsdp2_2d_state_dict.py).
"""

from conftest import (
    clean_env, gathered_tail, only_torch, ranks_result, run_newest_torch_json, where_patch_applies,
    where_patch_does_not_apply
)
from test_patch_fsdp2_2d_state_dict import (  # the same float64 LM, imports, optimizer round trip, newest reader
    MODEL, NEWEST_READS_TEMPLATE, OPTIMIZER_ROUND_TRIP, RANKS_IMPORTS, STATE_DICT_ROUND_TRIPS
)

PATCH_ID = "fsdp2-hsdp-tp"
ENV_OFF = "TORCHPATCH_FSDP2_HSDP_TP"

RANKS = MODEL + RANKS_IMPORTS + """
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank, root = dist.get_rank(), os.environ["CKPT_DIR"]
mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
solo = dist.new_group([0])
ids = (torch.arange(16) * 7 % V).reshape(4, 4)  # the global batch: row r for data-parallel rank r
dp_rank = rank // 2

def hsdp_tp(offset):
    m = make(offset)
    parallelize_module(m, mesh["tp"], {"tok": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(),
                                       "down": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp_replicate", "dp_shard"])
    return m

def equals(m, reference):
    expected = dict(reference.named_parameters())
    return all(torch.equal(p.full_tensor(), expected[n]) for n, p in m.named_parameters())

def step(m, opt, batch):
    F.cross_entropy(m(batch).flatten(0, 1), batch.flatten()).backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
             for n, p in m.named_parameters()}
    opt.step()
    opt.zero_grad()
    return grads

out = {}
try:
    a = hsdp_tp(0)
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
if "error" not in out:
    ref = make(0)
    out["full_tensor"] = equals(a, ref)
    out["placements"] = {n: [f"S({pl.dim})" if pl.is_shard() else type(pl).__name__ for pl in p.placements]
                         for n, p in a.named_parameters()}
    out["mesh"] = list(a.up.weight.device_mesh.mesh_dim_names)
    dcp.save(get_model_state_dict(a), checkpoint_id=f"{root}/hsdp_tp")
""" + STATE_DICT_ROUND_TRIPS.replace("MAKE", "hsdp_tp").replace("FOLDER", "hsdp_tp") + """
    opt = torch.optim.AdamW(b.parameters(), lr=0.1, foreach=True)
    grads = step(b, opt, ids[dp_rank:dp_rank + 1])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=True)
    ref_grads = step(ref, ref_opt, ids)
    out["grads"] = all(torch.allclose(grads[n], g, rtol=0, atol=1e-12) for n, g in ref_grads.items())
    expected = dict(ref.named_parameters())
    out["weights"] = all(torch.allclose(p.full_tensor(), expected[n], rtol=0, atol=1e-12)
                         for n, p in b.named_parameters())
    dcp.save({"model": get_model_state_dict(b), "optim": get_optimizer_state_dict(b, opt)},
             checkpoint_id=f"{root}/opt")
""" + OPTIMIZER_ROUND_TRIP.replace("MAKE", "hsdp_tp").replace("*BATCH", "ids[dp_rank:dp_rank + 1]")

NEWEST_READS = NEWEST_READS_TEMPLATE.replace("FOLDER", "hsdp_tp")

CHECKS = ("full_tensor", "round_trip", "from_plain", "grads", "weights", "optimizer_round_trip")


def _ranks(tmp_path, **env):
    return ranks_result(RANKS + gathered_tail(PATCH_ID), nproc=8, tmp_path=tmp_path, timeout=300,
                        env=clean_env(TORCHPATCH="1", CKPT_DIR=str(tmp_path / "ckpt"), **env))


@where_patch_applies(PATCH_ID)
def test_native_refusal_when_switched_off(tmp_path):
    ranks = _ranks(tmp_path, **{ENV_OFF: "0"})
    assert all(r.get("error") == "NotImplementedError: Using TP with HSDP is not supported" for r in ranks), ranks
    assert ranks[0]["status"] != "applied"


@where_patch_applies(PATCH_ID)
def test_hsdp_tp_trains_and_checkpoints_as_one_process(tmp_path):
    ranks = _ranks(tmp_path)
    assert ranks[0]["status"] == "applied"
    assert all(r.get(check) is True for r in ranks for check in CHECKS), ranks
    assert ranks[0]["to_plain"] is True
    # the label says what each rank stores: TP's shard first, then FSDP's chunk of it, replicated over dp_replicate
    assert ranks[0]["mesh"] == ["tp", "dp_replicate", "dp_shard"]
    colwise = ["S(0)", "Replicate", "S(0)"]
    assert ranks[0]["placements"] == {"tok.weight": colwise, "up.weight": colwise, "up.bias": colwise,
                                      "down.weight": ["S(1)", "Replicate", "S(0)"]}
    # the newest torch reads what torch 2.4 saved, each shard where it belongs
    assert run_newest_torch_json(NEWEST_READS, str(tmp_path / "ckpt")) is True


@only_torch(">=2.5", "torch with HSDP + TP")
@where_patch_does_not_apply(PATCH_ID)
def test_newer_torch_needs_no_patch(tmp_path):
    ranks = _ranks(tmp_path, LM_ROWS="12")
    assert ranks[0]["status"] != "applied"
    assert all(r.get(check) is True for r in ranks for check in CHECKS), ranks

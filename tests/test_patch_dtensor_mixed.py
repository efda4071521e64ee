"""dtensor-implicit-replication and dtensor-op-fallback: plain tensors mixed with DTensors, and ops
without a sharding strategy, on 2 real ranks (gloo, CPU mesh).

Every value is compared with the same computation on the global tensors, on one process. The same
rank script runs natively (the failures users see) and with TORCHPATCH=1.
"""

from conftest import (
    LEAVE_WITHOUT_TEARDOWN, RESULT, clean_env, only_torch, rank_result, run_json, run_ranks,
    torch_matches
)

SCRIPT = """
import json, math, warnings, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed._tensor import DeviceMesh, Replicate, Shard, distribute_tensor

mesh = DeviceMesh("cpu", list(range(world)))
torch.manual_seed(0)  # the same global tensors on every rank
x = torch.randn(4, 6, dtype=torch.float64)
y = torch.randn(4, 6, dtype=torch.float64)
bias = torch.randn(6, dtype=torch.float64)
w = torch.randn(6, 3, dtype=torch.float64)

def full(t):  # a DTensor's global value (+ 0 waits on an async result)
    return t.redistribute(mesh, [Replicate()]).to_local() + 0

out = {}
def attempt(key, fn):
    try:
        out[key] = fn()
    except Exception as exc:
        out[key] = f"{type(exc).__name__}: {exc}"

shard = lambda t, dim=0: distribute_tensor(t, mesh, [Shard(dim)])
attempt("replicate_plus_plain", lambda: torch.equal(full(distribute_tensor(x, mesh, [Replicate()]) + y), x + y))
attempt("shard_times_broadcast", lambda: torch.equal(full(shard(x) * bias), x * bias))
attempt("shard_plus_full_plain", lambda: torch.equal(full(shard(x) + y), x + y))
attempt("shard_mm_plain_weight", lambda: torch.allclose(full(torch.mm(shard(x), w)), x @ w))
attempt("placements", lambda: str(list((shard(x) * bias).placements)))
local_shard = y.chunk(world)[rank]  # a local shard passed where the whole tensor is meant
attempt("shard_by_mistake", lambda: full(shard(x) + local_shard).shape[0])
try:
    from torch.distributed.tensor.experimental import implicit_replication
except ImportError:
    try:  # torch 2.2-2.4 natively
        from torch.distributed._tensor.experimental import implicit_replication
    except ImportError:
        implicit_replication = None
if implicit_replication is not None:
    def explicit():
        with implicit_replication():
            return list((shard(x) + local_shard).shape)
    attempt("explicit_block_mistake", explicit)  # torch's own semantics, unchecked

if hasattr(torch.library, "custom_op"):
    @torch.library.custom_op("tpmix::fused_attn", mutates_args=())
    def fused_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v

    @fused_attn.register_fake
    def _(q, k, v, mask):
        return torch.empty_like(q)

    B, H, S, D = 2, 4, 8, 5
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(S, S, dtype=torch.bool).tril()  # plain boolean causal mask
    ref = fused_attn(q, k, v, mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, dim in (("heads", 1), ("sequence", 2)):  # q/k/v sharded on heads, then on the sequence
            def call(dim=dim):
                res = fused_attn(shard(q, dim), shard(k, dim), shard(v, dim), mask)
                return [torch.allclose(full(res), ref), str(list(res.placements)), list(res.to_local().shape)]
            attempt("fused_" + name, call)
            attempt("fused_" + name + "_again", call)
        attempt("fused_dtensor_mask", lambda: torch.allclose(full(fused_attn(
            shard(q, 1), shard(k, 1), shard(v, 1), distribute_tensor(mask, mesh, [Replicate()]))), ref))
    out["fallback_warnings"] = [str(c.message) for c in caught if "tpmix" in str(c.message)]

    def registered():  # register_sharding (served on 2.4): a real strategy, sharded over heads
        from torch.distributed.tensor.experimental import register_sharding

        @torch.library.custom_op("tpmix::scaled", mutates_args=())
        def scaled(a: torch.Tensor, factor: float) -> torch.Tensor:
            return a * factor

        @scaled.register_fake
        def _(a, factor):
            return torch.empty_like(a)

        @register_sharding(torch.ops.tpmix.scaled.default)
        def scaled_sharding(a, factor):
            return [([Shard(0)], [Shard(0), None]), ([Replicate()], [Replicate(), None])]

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            res = scaled(shard(x), 3.0)
        return [torch.equal(full(res), x * 3.0), str(list(res.placements)),
                any("tpmix.scaled" in str(c.message) for c in seen)]
    attempt("register_sharding", registered)

import torchpatch
out["status"] = {k: v for k, v in torchpatch.status().items() if k.startswith("dtensor-")}
gathered = [None] * world
dist.all_gather_object(gathered, out)
if rank == 0:
    print(RESULT + json.dumps(dict(out, ranks_agree=all(g == out for g in gathered[1:]))), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN

MIXED = "got mixed torch.Tensor and DTensor"
NO_STRATEGY = "NotImplementedError: Operator tpmix.fused_attn.default does not have a sharding strategy registered."
MISTAKE = "looks like a local shard passed where the whole tensor is meant"


def run(tmp_path, **env):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = run_ranks(SCRIPT, env=clean_env(**env), tmp_path=tmp_path)
    out = rank_result(proc)
    assert out.pop("ranks_agree"), out
    return out, proc


@only_torch(">=2.1")
def test_native_failures(tmp_path):
    out, _ = run(tmp_path)
    for key in ("replicate_plus_plain", "shard_times_broadcast", "shard_plus_full_plain", "shard_mm_plain_weight"):
        assert MIXED in out[key], (key, out[key])
    if torch_matches(">=2.4"):  # with the plain mask, then with every input a DTensor
        assert MIXED in out["fused_heads"] and MIXED in out["fused_sequence"]
        assert out["fused_dtensor_mask"] == NO_STRATEGY
    assert out["status"] == {}


@only_torch(">=2.1")
def test_plain_tensors_replicate(tmp_path):
    out, proc = run(tmp_path, TORCHPATCH="1")
    assert out["replicate_plus_plain"] is True
    assert out["shard_times_broadcast"] is True and out["placements"] == "[Shard(dim=0)]"
    assert out["shard_plus_full_plain"] is True
    assert out["shard_mm_plain_weight"] is True
    # The shard passed by mistake: a clear error on every rank, never garbage.
    assert out["shard_by_mistake"].startswith("RuntimeError: torchpatch (dtensor-implicit-replication)")
    assert MISTAKE in out["shard_by_mistake"] and "shape (2, 6)" in out["shard_by_mistake"]
    if "explicit_block_mistake" in out:  # inside torch's own context: torch's semantics, not ours
        assert MISTAKE not in str(out["explicit_block_mistake"])
    assert out["status"]["dtensor-implicit-replication"] == "applied"


@only_torch(">=2.2", "torch 2.1 has no implicit_replication of its own")
def test_explicit_block_keeps_torch_semantics(tmp_path):
    native, _ = run(tmp_path / "native")
    patched, _ = run(tmp_path / "patched", TORCHPATCH="1", TORCHPATCH_DISABLE="dtensor-op-fallback")
    assert patched["explicit_block_mistake"] == native["explicit_block_mistake"]


@only_torch(">=2.4", "torch.library.custom_op and register_op_strategy")
def test_op_without_strategy_falls_back(tmp_path):
    out, proc = run(tmp_path, TORCHPATCH="1")
    # q/k/v sharded on heads, then on the sequence, with a plain mask: the attention of the whole
    # tensors, resharded like q.
    assert out["fused_heads"] == [True, "[Shard(dim=1)]", [2, 2, 8, 5]]
    assert out["fused_sequence"] == [True, "[Shard(dim=2)]", [2, 4, 4, 5]]
    assert out["fused_heads_again"] == out["fused_heads"] and out["fused_sequence_again"] == out["fused_sequence"]
    assert out["fused_dtensor_mask"] is True
    warning, = out["fallback_warnings"]  # one per op
    assert warning.startswith("torchpatch (dtensor-op-fallback): tpmix.fused_attn.default has no DTensor sharding strategy")
    assert "@register_sharding(torch.ops.tpmix.fused_attn.default)" in warning
    assert "def fused_attn_sharding(q, k, v, mask):" in warning
    # register_sharding (torch's on 2.5+, served on 2.4): a real strategy, no fallback.
    assert out["register_sharding"] == [True, "[Shard(dim=0)]", False]
    assert out["status"]["dtensor-op-fallback"] == "applied"


@only_torch(">=2.4")
def test_op_fallback_opt_out(tmp_path):
    out, _ = run(tmp_path, TORCHPATCH="1", TORCHPATCH_DTENSOR_OP_FALLBACK="0")
    assert out["fused_heads"] == NO_STRATEGY and out["fused_dtensor_mask"] == NO_STRATEGY
    assert out["shard_times_broadcast"] is True  # the other patch stays on
    assert "dtensor-op-fallback" not in out["status"]


@only_torch(">=2.1,<2.4", "torch 2.1 has no custom ops: the fallback does not apply")
def test_op_fallback_inactive_before_2_4():
    out = run_json(
        "import json, torchpatch, torch.distributed._tensor; print(json.dumps(torchpatch.status()))",
        env=clean_env(TORCHPATCH="1"),
    )
    assert "dtensor-op-fallback" not in out and out.get("dtensor-implicit-replication") == "applied"


@only_torch("<2.1", "torch 1.13 has no DTensor")
def test_inactive_without_dtensor():
    out = run_json(
        "import json, torch, torch.distributed, torchpatch; print(json.dumps(torchpatch.status()))",
        env=clean_env(TORCHPATCH="1"),
    )
    assert "dtensor-implicit-replication" not in out and "dtensor-op-fallback" not in out


@only_torch(">=2.1")
def test_implicit_replication_opt_out(tmp_path):
    out, _ = run(tmp_path, TORCHPATCH="1", TORCHPATCH_DTENSOR_IMPLICIT_REPLICATION="0")
    assert MIXED in out["shard_times_broadcast"]


CONTEXT_PARALLEL = """
import json, torch, torch.distributed as dist, torch.nn.functional as F
dist.init_process_group("gloo")
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental import _attention as cp_attention
from torch.distributed.tensor.experimental._attention import context_parallel_unshard

mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
# The one-process references first: torch 2.9's context_parallel leaves its SDPA wrapper installed
# when the block raises (no try/finally), which would turn a later plain call into a sharded one.
refs = {causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal) for causal in (False, True)}
out = {}
for balance in (True, False):
    cp_attention._cp_options.enable_load_balance = balance
    for causal in (False, True):
        ref = refs[causal]
        qq, kk, vv = q.clone(), k.clone(), v.clone()
        key = f"balance={balance},causal={causal}"
        try:
            with context_parallel(mesh, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2]):
                res = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            full, = context_parallel_unshard(mesh, [res], [2])
            out[key] = [list(res.shape), torch.allclose(full, ref)]
        except Exception as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
if dist.get_rank() == 0:
    print(RESULT + json.dumps(out), flush=True)
""".replace("RESULT", repr(RESULT)) + LEAVE_WITHOUT_TEARDOWN


@only_torch(">=2.9", "context_parallel with load balancing on CPU (torch 2.9+)")
def test_context_parallel_on_cpu(tmp_path):
    """The seed's case: attention inside context_parallel on CPU, whose SDPA kernel context parallel
    does not implement. The fallback is exact on contiguous sequence shards, and refuses (rather than
    computing over the reordered sequence) under load balancing."""
    # torch 2.13+ computes non-causal attention itself, with a strategy derived from its decomposition
    # (30 s of CPU in each rank the first time): a case torchpatch has no part in, left out there.
    decomposes = torch_matches(">=2.13")
    script = CONTEXT_PARALLEL.replace("(False, True)", "(True,)") if decomposes else CONTEXT_PARALLEL
    native = rank_result(run_ranks(script, env=clean_env(), tmp_path=tmp_path))
    for balance in (True, False):
        assert "does not have a sharding strategy registered" in native[f"balance={balance},causal=True"], native
    patched = rank_result(run_ranks(script, env=clean_env(TORCHPATCH="1"), tmp_path=tmp_path))
    assert patched["balance=False,causal=True"] == [[1, 2, 4, 4], True]  # contiguous shards: exact
    refusals = ["balance=True,causal=True"]  # reordered shards: refused, never wrong
    if not decomposes:  # torch 2.9 has no strategy for non-causal attention either: computed, or refused
        assert patched["balance=False,causal=False"] == [[1, 2, 4, 4], True]
        assert "does not have a sharding strategy registered" in native["balance=True,causal=False"], native
        refusals.append("balance=True,causal=False")
    for key in refusals:
        refused = patched[key]
        assert refused.startswith("RuntimeError: torchpatch (dtensor-op-fallback): aten._scaled_dot_product"), refused
        assert "enable_load_balance = False" in refused


LATE_INSTALL = """
import json, warnings, torch, torch.distributed as dist
from torch.distributed._tensor import Shard, distribute_tensor  # DTensor imported natively first
from torch.distributed.device_mesh import init_device_mesh
import torchpatch
torchpatch.install()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))

@torch.library.custom_op("tplate::double", mutates_args=())
def double(q: torch.Tensor) -> torch.Tensor:
    return q * 2

@double.register_fake
def _(q):
    return torch.empty_like(q)

x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    results = [double(x) for _ in range(2)]
print(json.dumps({"status": torchpatch.status().get("dtensor-op-fallback"),
                  "results": [[str(list(r.placements)), torch.equal(r.to_local(), x.to_local() * 2)] for r in results]}))
"""


@only_torch(">=2.4")
def test_op_fallback_after_a_late_install():
    """``torchpatch.install()`` after DTensor was imported: the propagator made then had bound
    torch's method into its sharding cache; the patch routes a new cache through its hook."""
    out = run_json(LATE_INSTALL, env=clean_env())
    assert out == {"status": "applied", "results": [["[Shard(dim=0)]", True]] * 2}

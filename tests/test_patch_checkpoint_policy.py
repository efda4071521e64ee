"""checkpoint-policy: selective activation checkpointing on torch 2.1-2.4 (served), torch's own on
2.5+; torchtitan's private ``_pt2_selective_checkpoint_context_fn_gen`` wherever torch lacks it.

One script runs everywhere: a 2-block attention + MLP model, checkpointed per block under several
policies. A TorchDispatchMode counts ops in forward and in backward; what backward runs beyond the
uncheckpointed reference is what was recomputed. Expected counts come from the model's structure
(its Linear modules each run one ``mm``, attention two ``bmm``), so the same assertions hold on the
served implementation and on torch 2.9/2.13's native one.
"""

import pytest

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

SCRIPT = r"""
import collections, json, torch, torch.nn as nn, torch.nn.functional as F
import torch.utils.checkpoint as cp
from torch.utils.checkpoint import (checkpoint, CheckpointPolicy, SelectiveCheckpointContext,
                                    create_selective_checkpoint_contexts)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, CheckpointImpl

aten = torch.ops.aten
OPS = {"mm": aten.mm.default, "bmm": aten.bmm.default, "softmax": aten._softmax.default, "gelu": aten.gelu.default}
BLOCKS, D = 2, 8


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func] += 1
        return func(*args, **(kwargs or {}))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        return self.wo(torch.softmax(q @ k.transpose(1, 2) / D ** 0.5, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.w1, self.w2 = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)
        self.scale = nn.Parameter(torch.ones(D))  # its mul saves the block's last sum: recomputation
                                                  # runs to the end (checkpoint stops early otherwise)

    def forward(self, x):
        h = x + self.attention(x)
        return (h + self.w2(F.gelu(self.w1(h)))) * self.scale


# what one forward runs, from the structure: each Linear one mm, each Attention two bmm, one
# softmax, each Block one gelu
def structure(model):
    mods = list(model.modules())
    return {"mm": sum(isinstance(m, nn.Linear) for m in mods), "bmm": 2 * sum(isinstance(m, Attention) for m in mods),
            "softmax": sum(isinstance(m, Attention) for m in mods), "gelu": sum(isinstance(m, Block) for m in mods)}


def run(wrap):
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
    x = torch.randn(2, 5, D, requires_grad=True)
    layers = [wrap(b) for b in blocks]
    with Count() as fwd:
        h = x
        for layer in layers:
            h = layer(h)
        loss = h.square().mean()
    with Count() as bwd:
        loss.backward()
    return fwd.calls, bwd.calls, [x.grad] + [p.grad for p in blocks.parameters()], structure(blocks)


def with_checkpoint(context_fn=None):
    kw = {} if context_fn is None else {"context_fn": context_fn}
    return lambda block: (lambda h: checkpoint(block, h, use_reentrant=False, **kw))


ctx_seen = []


def policy_of(choose):
    def policy(ctx, func, *args, **kwargs):
        ctx_seen.append(isinstance(ctx, SelectiveCheckpointContext) and isinstance(ctx.is_recompute, bool))
        return choose(func)
    return policy


def must_save(*ops):
    return policy_of(lambda f: CheckpointPolicy.MUST_SAVE if f in ops else CheckpointPolicy.PREFER_RECOMPUTE)


def titan_public():
    # torchtitan's policy after its PR #397: save mm except every second one (per region)
    meta = collections.defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == aten.mm.default:
            meta[key] += 1
        save = func in {aten.mm.default} and not (func == aten.mm.default and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def titan_private():
    # torchtitan before PR #397, verbatim in shape: (mode, func) -> bool
    from torch.utils.checkpoint import _pt2_selective_checkpoint_context_fn_gen
    meta = collections.defaultdict(int)

    def _custom_policy(mode, func, *args, **kwargs):
        mm_count_key = f"{mode}_mm_count"
        if func == torch.ops.aten.mm.default:
            meta[mm_count_key] += 1
        return func in {aten.mm.default} and not (func == torch.ops.aten.mm.default and meta[mm_count_key] % 2 == 0)
    return _pt2_selective_checkpoint_context_fn_gen(_custom_policy)


MM, BMM, SOFTMAX, GELU = OPS.values()
SCENARIOS = {
    "full": with_checkpoint(),
    "policy_save_mm": with_checkpoint(lambda: create_selective_checkpoint_contexts(must_save(MM))),
    "list_save_mm": with_checkpoint(lambda: create_selective_checkpoint_contexts([MM])),
    "prefer_save_mm": with_checkpoint(lambda: create_selective_checkpoint_contexts(
        policy_of(lambda f: CheckpointPolicy.PREFER_SAVE if f is MM else CheckpointPolicy.MUST_RECOMPUTE))),
    "bool_save_mm": with_checkpoint(lambda: create_selective_checkpoint_contexts(policy_of(lambda f: f is MM))),
    "recompute_mm_save_rest": with_checkpoint(lambda: create_selective_checkpoint_contexts(policy_of(
        lambda f: CheckpointPolicy.MUST_RECOMPUTE if f is MM
        else CheckpointPolicy.MUST_SAVE if f in (BMM, SOFTMAX, GELU) else CheckpointPolicy.PREFER_RECOMPUTE))),
    "save_everything": with_checkpoint(lambda: create_selective_checkpoint_contexts(  # views included
        policy_of(lambda f: CheckpointPolicy.MUST_SAVE))),
    "titan_public": lambda b: checkpoint_wrapper(b, context_fn=titan_public, preserve_rng_state=False),
    "titan_private": lambda b: checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=checkpoint,
                                                  context_fn=titan_private, use_reentrant=False, preserve_rng_state=False),
}

ref_fwd, ref_bwd, ref_grads, struct = run(lambda b: b)
out = {"blocks": BLOCKS, "structure": struct, "reference_forward": {k: ref_fwd[op] for k, op in OPS.items()}, "scenarios": {}}
for name, wrap in SCENARIOS.items():
    fwd, bwd, grads, _ = run(wrap)
    out["scenarios"][name] = {
        "recomputed": {k: bwd[op] - ref_bwd[op] for k, op in OPS.items()},
        "forward": {k: fwd[op] for k, op in OPS.items()},
        "grads_equal": all(torch.equal(a, b) for a, b in zip(grads, ref_grads)),
    }
out["ctx_ok"] = bool(ctx_seen) and all(ctx_seen)


def error_of(fn):
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


w = torch.randn(4, 4, requires_grad=True)


def mutated(allow):
    def f(x):
        y = x @ w
        y.mul_(2)  # in place on an output SAC cached
        return y.sin()
    x = torch.randn(3, 4, requires_grad=True)
    ctx = lambda: create_selective_checkpoint_contexts([MM], allow_cache_entry_mutation=allow)
    checkpoint(f, x, use_reentrant=False, context_fn=ctx).sum().backward()


def twice():
    x = torch.randn(3, 4, requires_grad=True)
    y = checkpoint(lambda t: (t @ w).sin(), x, use_reentrant=False,
                   context_fn=lambda: create_selective_checkpoint_contexts([MM]))
    y.sum().backward(retain_graph=True)
    y.sum().backward()


out["errors"] = {
    "mutated": error_of(lambda: mutated(False)),
    "mutation_allowed": error_of(lambda: mutated(True)),
    "backward_twice": error_of(twice),
    "packet": error_of(lambda: create_selective_checkpoint_contexts([aten.mm])),
    "not_callable": error_of(lambda: create_selective_checkpoint_contexts(3)),
}
out["enum"] = [m.name for m in CheckpointPolicy][:4]
out["modules"] = {n: getattr(cp, n).__module__ for n in
                  ("CheckpointPolicy", "SelectiveCheckpointContext", "create_selective_checkpoint_contexts",
                   "_pt2_selective_checkpoint_context_fn_gen")}
try:
    import torchpatch
    out["status"] = torchpatch.status().get("checkpoint-policy")
except ImportError:
    out["status"] = None
print(json.dumps(out))
"""

SERVED_BY = "torchpatch.patches.activation_checkpoint.checkpoint_policy"


@pytest.fixture(scope="module")
def patched():
    return run_json(SCRIPT, env=clean_env(TORCHPATCH="1"), timeout=300)


@only_torch(">=2.1,<2.5", "torch 2.5 made selective activation checkpointing public")
def test_native_failure():
    proc = run_py("from torch.utils.checkpoint import CheckpointPolicy")
    assert "ImportError: cannot import name 'CheckpointPolicy' from 'torch.utils.checkpoint'" in proc.stderr
    proc = run_py("from torch.utils.checkpoint import create_selective_checkpoint_contexts")
    assert "ImportError: cannot import name 'create_selective_checkpoint_contexts'" in proc.stderr


@only_torch(">=2.1,!=2.4.*", "torch 2.4 is the one release with the private name")
def test_native_failure_private_name():
    proc = run_py("from torch.utils.checkpoint import _pt2_selective_checkpoint_context_fn_gen")
    assert "ImportError: cannot import name '_pt2_selective_checkpoint_context_fn_gen'" in proc.stderr


@where_patch_applies("checkpoint-policy")
def test_policy_is_honoured(patched):
    s, blocks = patched["structure"], patched["blocks"]
    assert min(s.values()) > 0 and s["mm"] % blocks == 0
    assert patched["reference_forward"] == s  # the counter sees every op of the forward pass
    none = {k: 0 for k in s}
    sc = patched["scenarios"]
    assert all(v["grads_equal"] for v in sc.values()), {k: v["grads_equal"] for k, v in sc.items()}
    assert all(v["forward"] == s for v in sc.values())  # saving never re-runs the forward
    assert sc["full"]["recomputed"] == s  # plain checkpoint recomputes the whole region
    for name in ("policy_save_mm", "list_save_mm", "prefer_save_mm", "bool_save_mm"):
        assert sc[name]["recomputed"] == dict(s, mm=0), name  # mm saved, the rest recomputed
    assert sc["recompute_mm_save_rest"]["recomputed"] == dict(none, mm=s["mm"])
    assert sc["save_everything"]["recomputed"] == none
    # every second mm of each checkpointed block recomputed (torchtitan's policy, both spellings)
    every_second = dict(s, mm=blocks * (s["mm"] // blocks // 2))
    assert sc["titan_public"]["recomputed"] == every_second
    assert sc["titan_private"]["recomputed"] == every_second
    assert patched["ctx_ok"]


@where_patch_applies("checkpoint-policy")
def test_errors_match_torch(patched):
    e = patched["errors"]
    assert e["mutated"] == "RuntimeError: Tensor cached during selective activation checkpoint has been mutated"
    assert e["mutation_allowed"] is None
    assert e["backward_twice"].startswith("RuntimeError: Trying to backward an extra time")
    assert e["packet"].startswith("ValueError: Expected op in `op_list` to be an OpOverload")
    assert "OpOverloadPacket" in e["packet"]
    assert e["not_callable"] == "TypeError: policy_fn_or_list must be either a function or a list of ops."
    assert patched["enum"] == ["MUST_SAVE", "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE"]


@only_torch(">=2.1,<2.4")
def test_served_on_2_1_to_2_3(patched):
    assert set(patched["modules"].values()) == {SERVED_BY}
    assert patched["status"] == "applied"


@only_torch(">=2.4,<2.5")
def test_served_on_2_4_beside_torchs_private_name(patched):
    mods = patched["modules"]
    assert mods.pop("_pt2_selective_checkpoint_context_fn_gen") == "torch.utils.checkpoint"  # torch's own
    assert set(mods.values()) == {SERVED_BY}
    assert patched["status"] == "applied"


@only_torch(">=2.5", "torch has the public API: only the private torchtitan name is served")
def test_public_names_are_torchs_own(patched):
    mods = patched["modules"]
    assert mods.pop("_pt2_selective_checkpoint_context_fn_gen") == SERVED_BY
    assert set(mods.values()) == {"torch.utils.checkpoint"}
    assert patched["status"] == "applied"


@only_torch(">=2.4,<2.5", "torch 2.4 is the only served version whose torch.compile accepts context_fn")
def test_compile_refused_clearly():
    out = run_py(
        """
        import torch, torch._dynamo
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        torch._dynamo.config._experimental_support_context_fn_in_torch_utils_checkpoint = True
        ctx = lambda: create_selective_checkpoint_contexts([torch.ops.aten.mm.default])
        fn = torch.compile(lambda x, w: checkpoint(lambda a: (a @ w).sin(), x, use_reentrant=False, context_fn=ctx),
                           backend="aot_eager")
        fn(torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)).sum().backward()
        """,
        env=clean_env(TORCHPATCH="1"), timeout=300,
    )
    assert "NotImplementedError: torchpatch serves selective activation checkpointing" in out.stderr, out.stderr[-3000:]


@only_torch(">=2.1,<2.5")
def test_opt_out_restores_the_native_failure():
    proc = run_py("from torch.utils.checkpoint import CheckpointPolicy",
                  env=clean_env(TORCHPATCH="1", TORCHPATCH_CHECKPOINT_POLICY="0"))
    assert "ImportError: cannot import name 'CheckpointPolicy'" in proc.stderr


WRAPPER = """
import contextlib, json, torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, CheckpointImpl
contexts = lambda: (contextlib.nullcontext(), contextlib.nullcontext())
lin = torch.nn.Linear(4, 4)
def run(**kw):
    try:
        wrapped = checkpoint_wrapper(lin, **kw)
        wrapped(torch.randn(2, 4, requires_grad=True)).sum().backward()
        return wrapped.checkpoint_impl.name
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
print(json.dumps({"context_fn": run(context_fn=contexts, preserve_rng_state=False),
                  "explicit_reentrant": run(checkpoint_impl=CheckpointImpl.REENTRANT, context_fn=contexts),
                  "plain": run()}))
"""


@only_torch(">=2.1,<2.2", "torch 2.2 made NO_REENTRANT checkpoint_wrapper's default")
def test_checkpoint_wrapper_with_context_fn_on_2_1():
    refused = "ValueError: Passing `context_fn` or `debug` is only supported when use_reentrant=False."
    native = run_json(WRAPPER)
    assert native == {"context_fn": refused, "explicit_reentrant": refused, "plain": "REENTRANT"}
    patched = run_json(WRAPPER, env=clean_env(TORCHPATCH="1"))
    # torchtitan's call works; an explicit REENTRANT and calls without context_fn are untouched
    assert patched == {"context_fn": "NO_REENTRANT", "explicit_reentrant": refused, "plain": "REENTRANT"}

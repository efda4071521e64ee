"""dtensor-context-parallel-210: torch 2.10's context-parallel names that modules import at load time.

One process imports them as torchtitan 0.3's ``distributed/context_parallel/api.py`` and 0.2.2's
``distributed/context_parallel.py`` do. Natively on
torch 2.9 the import raises ``ImportError``; with TORCHPATCH=1 it succeeds there, as it does natively on
torch 2.10+ (the newest torch validates the names), and where the patch applies each name raises its
``NotImplementedError`` when called or constructed (context parallel itself is not served).
"""

from conftest import clean_env, run_json, through_patch_range, where_patch_applies

IMPORT = """
import json
try:
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard, _enable_context_parallel_dispatcher, _HeadTailLoadBalancer, _PTRRLoadBalancer,
        _ContextParallel)
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.experimental._context_parallel._attention import flex_cp_allgather
    out = {"import": "ok", "style": issubclass(_ContextParallel, ParallelStyle),
           "attention_types": {kind.name: kind.value for kind in _ContextParallel.AttentionType}}
except ImportError:
    out = {"import": "ImportError"}
else:
    uses = {"_context_parallel_shard": lambda: _context_parallel_shard(None, [], [], None),
            "_enable_context_parallel_dispatcher": _enable_context_parallel_dispatcher,
            "_HeadTailLoadBalancer": lambda: _HeadTailLoadBalancer(8, 2, "cpu"),
            "_PTRRLoadBalancer": lambda: _PTRRLoadBalancer(None, 2),
            "flex_cp_allgather": lambda: flex_cp_allgather(None, None, 2, None),
            "_ContextParallel": lambda: _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX)}
    for name, use in uses.items():
        try:
            use()
            out[name] = "ran"
        except NotImplementedError as exc:
            out[name] = "NotImplementedError" if "not serve" in str(exc) else str(exc)
        except Exception as exc:
            out[name] = type(exc).__name__
import torchpatch
out["status"] = torchpatch.status().get("dtensor-context-parallel-210")
print(json.dumps(out))
"""


@where_patch_applies("dtensor-context-parallel-210", "torch 2.9 has the older context parallel")
def test_native_import_fails():
    assert run_json(IMPORT, env=clean_env()) == {"import": "ImportError", "status": None}


@through_patch_range("dtensor-context-parallel-210", "the names import")
def test_names_import():
    out = run_json(IMPORT, env=clean_env(TORCHPATCH="1"))
    assert out["import"] == "ok", out
    assert out["style"] is True
    assert out["attention_types"] == {"FLEX": "flex_attention", "SDPA": "scaled_dot_product_attention"}


@where_patch_applies("dtensor-context-parallel-210", "context parallel is not served")
def test_each_name_raises_when_used():
    out = run_json(IMPORT, env=clean_env(TORCHPATCH="1"))
    assert out.pop("status") == "applied"
    for key in ("style", "attention_types"):
        out.pop(key)
    assert out == {"import": "ok", **{name: "NotImplementedError" for name in (
        "_context_parallel_shard", "_enable_context_parallel_dispatcher", "_HeadTailLoadBalancer",
        "_PTRRLoadBalancer", "flex_cp_allgather", "_ContextParallel")}}, out

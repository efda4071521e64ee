"""varlen-attention-op: torch 2.10's ``torch.ops.torch_attn._varlen_attn`` on torch 2.4-2.9.

Without torchpatch the operator is missing. With it (and natively on torch >= 2.10) it exists once
``torch.nn.attention.varlen`` is imported, with torch 2.15's schema; on CPU it raises the flash
kernel's own ``NotImplementedError`` as torch 2.15's does (flash attention is CUDA-only), on meta
tensors it gives 2.15's output shapes.
"""

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies


@where_patch_applies("varlen-attention-op", "torch 2.10 added it")
def test_native_attribute_error():
    proc = run_py("import torch; torch.ops.torch_attn._varlen_attn")
    assert "no attribute '_varlen_attn'" in proc.stderr, proc.stderr[-2000:]


SCRIPT = """
import json, torch
import torch.nn.attention.varlen
op = torch.ops.torch_attn._varlen_attn
args = lambda device: (torch.randn(6, 2, 8, device=device), torch.randn(6, 2, 8, device=device),
                       torch.randn(6, 2, 8, device=device), torch.tensor([0, 2, 6], dtype=torch.int32, device=device),
                       torch.tensor([0, 2, 6], dtype=torch.int32, device=device), 4, 4)
out = {"schema": str(op.default._schema)}
meta = op(*args("meta"), is_causal=True)
out["meta"] = [list(t.shape) for t in meta] + [str(meta[2].dtype)]
try:
    op(*args("cpu"))
except NotImplementedError as exc:
    out["cpu"] = "NotImplementedError"
import torchpatch
out["status"] = torchpatch.status().get("varlen-attention-op")
print(json.dumps(out))
"""


@through_patch_range("varlen-attention-op")
def test_operator_as_torch_2_15_defines_it():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["schema"].startswith("torch_attn::_varlen_attn(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, "
                                    "Tensor? cu_seq_k, SymInt max_q, SymInt max_k, bool is_causal=False"), out
    assert out["meta"] == [[6, 2, 8], [2, 6], [2], "torch.uint64"]
    assert out["cpu"] == "NotImplementedError"

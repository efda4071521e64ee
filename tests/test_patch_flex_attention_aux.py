"""flex-attention-aux: ``AuxRequest``, ``AuxOutput``, ``FlexKernelOptions`` and
``flex_attention(..., return_aux=...)`` on torch 2.5-2.8, as torch 2.9+ has them.

The script runs eager FlexAttention on CPU in float64 with a score_mod and compares the output and the
logsumexp returned through ``return_aux=AuxRequest(lse=True)`` with the definition, and checks torch
2.15's errors (``return_lse`` with ``return_aux``; ``max_scores`` on CPU). It runs natively from 2.9 and
served where the patch applies (2.5-2.8, none of them in this matrix); so the served wrapper is also
exercised here directly, around a stand-in for torch 2.5-2.8's ``flex_attention`` (its signature, the
attention from the definition).
"""

import math

import pytest

from conftest import clean_env, run_json, run_py, through_patch_range, where_patch_applies

SCRIPT = """
import json, torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, FlexKernelOptions, flex_attention

def error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
bias = lambda s, b, h, qi, ki: s + (qi - ki) * 0.1
out, aux = flex_attention(q, k, v, score_mod=bias, return_aux=AuxRequest(lse=True))
s = q @ k.transpose(-1, -2) / 2 + (torch.arange(8)[:, None] - torch.arange(8)[None]) * 0.1
plain, empty = flex_attention(q, k, v, return_aux=AuxRequest())
print(json.dumps({
    "out": torch.allclose(out, s.softmax(-1) @ v, rtol=1e-10),
    "lse": torch.allclose(aux.lse, s.logsumexp(-1), rtol=1e-10),
    "aux": [type(aux).__name__, aux.max_scores, AuxRequest()._asdict(), list(AuxOutput._fields)],
    "no_request": [torch.allclose(plain, (q @ k.transpose(-1, -2) / 2).softmax(-1) @ v, rtol=1e-10), list(empty)],
    "max_cpu": error(flex_attention, q, k, v, return_aux=AuxRequest(max_scores=True)),
    "both": error(flex_attention, q, k, v, return_lse=True, return_aux=AuxRequest(lse=True)),
    "options": [FlexKernelOptions.__total__, sorted(FlexKernelOptions.__annotations__)],
    "modules": [AuxRequest.__module__, AuxOutput.__module__, FlexKernelOptions.__module__],
}))
"""

BOTH = ("Cannot specify both return_lse and return_aux. return_lse is deprecated, please use "
        "return_aux=AuxRequest(lse=True) instead.")


@where_patch_applies("flex-attention-aux")
def test_native_import_error():
    proc = run_py("from torch.nn.attention.flex_attention import AuxRequest")
    assert "ImportError: cannot import name 'AuxRequest'" in proc.stderr, proc.stderr[-2000:]


@through_patch_range("flex-attention-aux")
def test_return_aux_as_torch_2_15():
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"))
    assert out["out"] is True and out["lse"] is True
    assert out["aux"] == ["AuxOutput", None, {"lse": False, "max_scores": False}, ["lse", "max_scores"]]
    assert out["no_request"] == [True, [None, None]]
    # torch 2.15 (and the served wrapper) say "on CPU.", some earlier torch "on CPU/MPS."
    assert out["max_cpu"][0] == "NotImplementedError"
    assert out["max_cpu"][1].startswith("Returning max scores is not supported on CPU"), out["max_cpu"]
    assert out["both"] == ["ValueError", BOTH]
    assert out["options"][0] is False
    assert {"BLOCK_M", "BLOCK_N", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "num_warps", "num_stages"} <= set(out["options"][1])
    assert out["modules"] == ["torch.nn.attention.flex_attention"] * 3


def test_served_wrapper_around_torch_2_5_signature():
    torch = pytest.importorskip("torch")
    from torchpatch.patches.attention.flex_attention_aux import AuxOutput, AuxRequest, _with_return_aux

    calls = []

    def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                       return_lse=False, kernel_options=None):  # torch 2.5-2.8's signature
        calls.append((scale, return_lse, kernel_options))
        scores = query @ key.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(query.size(-1)))
        out = scores.softmax(-1) @ value
        return (out, scores.logsumexp(-1)) if return_lse else out

    served = _with_return_aux(flex_attention)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    s = q @ k.transpose(-1, -2) * 0.3
    out, aux = served(q, k, v, scale=0.3, kernel_options={"BLOCK_M": 16}, return_aux=AuxRequest(lse=True))
    assert isinstance(aux, AuxOutput) and aux.max_scores is None
    assert torch.allclose(out, s.softmax(-1) @ v, rtol=1e-12) and torch.allclose(aux.lse, s.logsumexp(-1), rtol=1e-12)
    plain, empty = served(q, k, v, scale=0.3, return_aux=AuxRequest())
    assert torch.allclose(plain, out, rtol=1e-12) and empty == AuxOutput()
    legacy = served(q, k, v, None, None, 0.3, False, True)  # return_lse positionally, as before
    assert torch.allclose(legacy[1], aux.lse, rtol=1e-12)
    assert calls == [(0.3, True, {"BLOCK_M": 16}), (0.3, False, None), (0.3, True, None)]
    with pytest.raises(ValueError, match="Cannot specify both return_lse and return_aux"):
        served(q, k, v, return_lse=True, return_aux=AuxRequest(lse=True))
    with pytest.raises(NotImplementedError, match="^Returning max scores is not supported on CPU.$"):
        served(q, k, v, return_aux=AuxRequest(max_scores=True))
    assert "return_aux" in __import__("inspect").signature(served).parameters

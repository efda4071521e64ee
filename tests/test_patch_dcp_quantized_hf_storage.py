"""dcp-quantized-hf-storage: ``torch.distributed.checkpoint.quantized_hf_storage``'s
``QuantizedHuggingFaceStorageReader`` on torch 2.4-2.8 (2.9+'s API and semantics).

The script writes a quantized Hugging Face checkpoint (two safetensors files and the index): two FP8
weights with ``weight_scale_inv`` block scales (one scale in the other file; blocks of 64 with partial
blocks at the edges), an MXFP4 ``_blocks``/``_scales`` pair and a plain bf16 tensor. It loads them
through the reader whole and, through CheckpointableTensor fields, as sub-regions (the sliced
reads), and compares with references computed in the run from the definition in float64 (each
element times its block's scale; each 4-bit E2M1 value times ``2 ** (scale - 127)``). Of the MXFP4
tensor torch 2.15 reads only the first ``groups`` values of each row (its planner intersects the
request with the stored 4-D chunk): the served reader must load exactly what 2.15 loads. It runs
served (TORCHPATCH=1) where the patch applies, natively on torch >= 2.14 (CheckpointableTensor), and
in torch 2.15's venv (``run_newest_torch_json``). Needs ``safetensors`` (skipped without it).
"""

import pytest

from conftest import clean_env, only_torch, run_json, run_newest_torch_json, run_py, torch_matches, where_patch_applies

pytest.importorskip("safetensors")

SCRIPT = """
import json, os, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader
path, BLOCK = sys.argv[1], 64
os.makedirs(path)
torch.manual_seed(0)
weights = {name: (torch.randn(shape) * 4).to(torch.float8_e4m3fn)
           for name, shape in (("layer.weight", (100, 130)), ("other.weight", (70, 64)))}
scales = {name + "_scale_inv": torch.rand(-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)) + 0.5
          for name, w in weights.items()}
blocks = torch.randint(0, 256, (2, 3, 4, 8), dtype=torch.uint8)
exponents = torch.randint(124, 131, (2, 3, 4), dtype=torch.uint8)
norm = torch.randn(8).to(torch.bfloat16)
files = {"model-00001-of-00002.safetensors": {"layer.weight": weights["layer.weight"], "norm": norm,
                                              **scales},
         "model-00002-of-00002.safetensors": {"other.weight": weights["other.weight"],
                                              "experts.w_blocks": blocks, "experts.w_scales": exponents}}
for name, tensors in files.items():
    save_file(tensors, os.path.join(path, name))
with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": {k: name for name, ts in files.items() for k in ts}}, f)

def fp8_reference(name):
    out = weights[name].to(torch.float64)
    scale = scales[name + "_scale_inv"]
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= scale[i, j].item()
    return out

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
mxfp4 = torch.empty(2, 3, 4 * 8 * 2, dtype=torch.float64)
for a in range(2):
    for b in range(3):
        for g in range(4):
            for k in range(8):
                byte, scale = int(blocks[a, b, g, k]), 2.0 ** (int(exponents[a, b, g]) - 127)
                mxfp4[a, b, g * 16 + 2 * k] = E2M1[byte & 15] * scale
                mxfp4[a, b, g * 16 + 2 * k + 1] = E2M1[byte >> 4] * scale
reference = {"layer.weight": fp8_reference("layer.weight"), "other.weight": fp8_reference("other.weight"),
             "experts.w_blocks": mxfp4, "norm": norm.to(torch.float64)}

full = {"layer.weight": torch.zeros(100, 130), "other.weight": torch.zeros(70, 64),
        "experts.w_blocks": torch.zeros(2, 3, 64), "norm": torch.zeros(8, dtype=torch.bfloat16)}
dcp.load(full, storage_reader=QuantizedHuggingFaceStorageReader(path, block_size=BLOCK))
half = {"layer.weight": torch.zeros(100, 130, dtype=torch.bfloat16)}
dcp.load(half, storage_reader=QuantizedHuggingFaceStorageReader(path, target_dtype=torch.bfloat16, block_size=BLOCK))

def region(shape, global_shape, offset):
    t = torch.zeros(shape)
    t.global_shape, t.global_offsets = global_shape, (offset,)
    t.local_offsets, t.local_sizes = ((0,) * len(shape),), (shape,)
    return t

part = {"layer.weight": region((60, 50), (100, 130), (10, 70)),
        "experts.w_blocks": region((1, 2, 30), (2, 3, 64), (1, 1, 20))}
dcp.load(part, storage_reader=QuantizedHuggingFaceStorageReader(path, block_size=BLOCK))
print(json.dumps({
    "full": {k: torch.equal(full[k], reference[k].to(full[k].dtype)) for k in full if k != "experts.w_blocks"},
    "bf16": torch.equal(half["layer.weight"], full["layer.weight"].to(torch.bfloat16)),
    "part": torch.equal(part["layer.weight"], reference["layer.weight"][10:70, 70:120].float()),
    # what torch 2.15 reads of an MXFP4 tensor: its planner intersects the request with the stored 4-D
    # chunk, whose dim 2 counts groups (4), so only the first 4 dequantized values of a row are read
    "mxfp4_read": torch.equal(full["experts.w_blocks"][..., :4], mxfp4[..., :4].float())
                  and not full["experts.w_blocks"][..., 4:].any(),
    "mxfp4": [full["experts.w_blocks"].tolist(), part["experts.w_blocks"].tolist()],
    "module": QuantizedHuggingFaceStorageReader.__module__,
    "block_size": QuantizedHuggingFaceStorageReader(path).block_size}))
"""

EXPECTED = {"full": {"layer.weight": True, "other.weight": True, "norm": True}, "bf16": True, "part": True,
            "mxfp4_read": True, "module": "torch.distributed.checkpoint.quantized_hf_storage", "block_size": 128}


def _check(out: dict, newest: dict) -> None:
    """``out`` has the expected results, and loaded the same MXFP4 values as torch 2.15."""
    assert {k: v for k, v in out.items() if k != "mxfp4"} == EXPECTED
    assert out["mxfp4"] == newest["mxfp4"]


@where_patch_applies("dcp-quantized-hf-storage", "torch 2.9 added the module")
def test_native_failure():
    proc = run_py("import torch.distributed.checkpoint.quantized_hf_storage")
    assert "No module named 'torch.distributed.checkpoint.quantized_hf_storage'" in proc.stderr


@where_patch_applies("dcp-quantized-hf-storage")
def test_served_dequantizes(tmp_path):
    newest = run_newest_torch_json(SCRIPT, str(tmp_path / "q215"))
    _check(run_json(SCRIPT, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "q"),)), newest)
    _check(newest, newest)


@where_patch_applies("dcp-quantized-hf-storage", "the served hf_storage reader is its base on 2.4-2.7")
def test_served_subclasses_hf_reader():
    code = """
import json, torchpatch
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader as Q
print(json.dumps([issubclass(Q, HuggingFaceStorageReader), torchpatch.status().get("dcp-quantized-hf-storage")]))
"""
    # on 2.8 its base is a reader made for it alone: 2.8's own HuggingFaceStorageReader has another API
    assert run_json(code, env=clean_env(TORCHPATCH="1")) == [torch_matches("<2.8"), "applied"]


@only_torch(">=2.14", "torch's own reader (and CheckpointableTensor for the sliced reads)")
def test_native_dequantizes(tmp_path):
    out = run_json(SCRIPT, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "q"),))
    _check(out, out)

"""Reference values of torch 2.13 (``tests/fixtures/reference``, made by ``tools/reference_values.py``)
and the snippet a test script uses to read them back as tensors."""

from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parent / "fixtures" / "reference"

# Source text for test scripts: load(name) -> the cases; tensor(obj) -> the tensor a case describes.
LOAD = """
import json, torch
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "bool": torch.bool, "int64": torch.int64}

def load(path):
    with open(path) as f:
        return json.load(f)["cases"]

def tensor(obj):
    if obj is None:
        return None
    data = [float(d) if isinstance(d, str) else d for d in obj["data"]]
    wide = torch.bool if obj["dtype"] == "bool" else torch.float64
    return torch.tensor(data, dtype=wide).to(DTYPES[obj["dtype"]]).reshape(obj["shape"])

def same(a, b):
    \"\"\"Bitwise equal values (NaN where the other has NaN), as a JSON-friendly verdict.\"\"\"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    nan = a.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
    if not torch.equal(nan, b.isnan() if b.is_floating_point() else nan):
        return "NaN in different places"
    if torch.equal(a[~nan], b[~nan]):
        return True
    diff = (a[~nan].double() - b[~nan].double()).abs()
    rel = diff / b[~nan].double().abs().clamp_min(1e-30)
    return {"max_abs": diff.max().item(), "max_rel": rel.max().item(), "n_differ": int((diff > 0).sum())}
"""

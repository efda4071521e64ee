"""Inputs for the backported functions' tests (``tests/fixtures/reference``, made by
``tools/reference_values.py``) and the snippet a test script uses to read them back as tensors.

The files hold inputs, arguments and the error messages torch 2.13 raises: nothing a CPU computed.
Expected *values* are never recorded (a float kernel's last bits depend on the CPU's vector width and
hence on the reduction order: AVX-512, AVX2 and plain builds of one torch differ). Each test computes
its numeric reference in its own run: from the definition, in float64, with a tolerance derived from
the computation's rounding errors (``within``), and bit for bit against something computed in the same
process (``same``).
"""

from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parent / "fixtures" / "reference"

# Source text for test scripts: load(name) -> the cases; tensor(obj) -> the tensor a case describes;
# same(a, b) -> bitwise verdict; within(got, ref, tol) -> verdict of |got - ref| <= tol.
LOAD = """
import json, torch
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "bool": torch.bool, "int64": torch.int64}
# Unit roundoff (half the distance from 1 to the next number) of each floating dtype.
UNIT_ROUNDOFF = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24,
                 torch.float64: 2.0 ** -53}

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

def within(got, ref, tol):
    \"\"\"|got - ref| <= tol elementwise (ref and tol float64 tensors of got's shape; a NaN or inf in got
    fails), as a JSON-friendly verdict.\"\"\"
    if tuple(got.shape) != tuple(ref.shape):
        return f"shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    err = (got.double() - ref).abs()
    over = ~(err <= tol)
    if not bool(over.any()):
        return True
    return {"n_over": int(over.sum()), "n": over.numel(), "max_err": err[over].max().item(),
            "max_err_over_tol": (err[over] / tol[over]).max().item()}
"""

"""Test inputs for the patches that backport torch 2.13's functions to older torch.

    python tools/reference_values.py            # print a summary of the cases
    python tools/reference_values.py --write    # rewrite tests/fixtures/reference/*.json
    python tools/reference_values.py --check    # exit 1 if the files differ from what this would write

Run it with torch 2.13 (the error messages are torch 2.13's). Inputs are made from Python's own
``random`` (rounded to the tensor's dtype), so they do not depend on any torch's generator; the
files hold the inputs, the arguments and, for invalid inputs, the first line of the error torch 2.13
raises: nothing a CPU computed, so ``--check`` passes on any machine. No expected *values* are
recorded: a float kernel's last bits depend on the CPU (AVX-512, AVX2 and plain builds of one torch
reduce in different orders), so each test computes its references in its own run (the definition in
float64 within a derived tolerance, and torch's own functions in the same process, bit for bit):
- ``sdpa.json``: ``F.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.MATH)`` (the
  sdpa-backport patch on torch 1.13), ``tests/test_patch_sdpa_backport.py``;
- ``clip_grads.json``: ``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_`` (the
  nn-utils-clip-grads patch on torch < 2.6), ``tests/test_patch_nn_utils_clip_grads.py``; a case's
  ``max_norm`` is its ``max_norm_ratio`` times the total norm the test computes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "reference"
REFERENCE_TORCH = "2.13"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "bool": torch.bool, "int64": torch.int64}


def encode(t: torch.Tensor) -> Dict[str, Any]:
    name = str(t.dtype).replace("torch.", "")
    data = t.flatten().tolist() if t.dtype in (torch.bool, torch.float64) else t.double().flatten().tolist()
    return {"shape": list(t.shape), "dtype": name, "data": [d if isinstance(d, bool) else _json_float(d) for d in data]}


def _json_float(x: float) -> Any:
    return x if x == x and abs(x) != float("inf") else repr(x)  # nan/inf as strings: strict JSON


def decode(obj: Optional[Dict[str, Any]]) -> Optional[torch.Tensor]:
    """The tensor ``encode`` described (the tests use the same code, inlined)."""
    if obj is None:
        return None
    data = [float(d) if isinstance(d, str) else d for d in obj["data"]]
    return torch.tensor(data, dtype=torch.float64 if obj["dtype"] != "bool" else torch.bool).to(
        DTYPES[obj["dtype"]]).reshape(obj["shape"])


def values(rng: random.Random, shape: Sequence[int], dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.tensor([rng.uniform(-scale, scale) for _ in range(n)], dtype=torch.float64)
            .to(dtype).reshape(list(shape)))


# -- scaled_dot_product_attention ---------------------------------------------------------------
def sdpa_cases() -> List[Dict[str, Any]]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    rng = random.Random(20241)  # the draws' order fixes every input: keep it
    f32 = torch.float32
    bool_mask = torch.tensor([[True, False, True, True, False], [False] * 5, [True, True, False, True, True]])
    full_row = values(rng, (1, 1, 3, 5))
    full_row[0, 0, 2] = float("-inf")
    specs = [
        ("plain", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), f32, {}, None),
        ("bool mask, a row fully masked", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), f32, {}, bool_mask),
        ("float mask broadcast over heads", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 3), f32, {}, values(rng, (2, 1, 3, 5))),
        ("float mask, a row all -inf", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), f32, {}, full_row),
        ("causal, L < S", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), f32, {"is_causal": True}, None),
        ("causal, L > S", (1, 2, 5, 4), (1, 2, 3, 4), (1, 2, 3, 4), f32, {"is_causal": True}, None),
        ("scale", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), f32, {"scale": 0.3}, None),
        ("negative scale", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), f32, {"scale": -0.7}, None),
        ("grouped-query attention", (1, 4, 3, 4), (1, 2, 5, 4), (1, 1, 5, 3), f32, {"enable_gqa": True}, None),
        ("3-D inputs", (2, 3, 4), (2, 5, 4), (2, 5, 3), f32, {}, None),
        ("5-D inputs", (2, 1, 2, 3, 4), (2, 1, 2, 5, 4), (2, 1, 2, 5, 3), f32, {}, None),
        ("bfloat16, bool mask", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), torch.bfloat16, {}, bool_mask),
        ("float16, causal", (1, 2, 4, 4), (1, 2, 4, 4), (1, 2, 4, 4), torch.float16, {"is_causal": True}, None),
        ("float16, float32 mask", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4), torch.float16, {}, values(rng, (3, 5))),
        ("float64", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), torch.float64, {"scale": 0.25}, None),
        ("large logits", (1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 3), f32, {"scale": 40.0}, None),
    ]
    cases = []
    for name, qs, ks, vs, dtype, kwargs, mask in specs:
        q, k, v = values(rng, qs, dtype, 2.0), values(rng, ks, dtype, 2.0), values(rng, vs, dtype, 2.0)
        cases.append({"name": name, "query": encode(q), "key": encode(k), "value": encode(v),
                      "attn_mask": None if mask is None else encode(mask), "kwargs": kwargs})
    errors = [
        ("error: dtypes differ", values(rng, (1, 3, 4)), values(rng, (1, 5, 4), torch.float64), values(rng, (1, 5, 4)), {}, None),
        ("error: 1-D query", values(rng, (4,)), values(rng, (5, 4)), values(rng, (5, 4)), {}, None),
        ("error: integer mask", values(rng, (1, 3, 4)), values(rng, (1, 5, 4)), values(rng, (1, 5, 4)), {},
         torch.zeros(3, 5, dtype=torch.int64)),
        ("error: float64 mask, float32 query", values(rng, (1, 3, 4)), values(rng, (1, 5, 4)), values(rng, (1, 5, 4)), {},
         torch.zeros(3, 5, dtype=torch.float64)),
        ("error: causal and a mask", values(rng, (1, 3, 4)), values(rng, (1, 5, 4)), values(rng, (1, 5, 4)),
         {"is_causal": True}, torch.zeros(3, 5)),
        ("error: key heads do not divide query heads", values(rng, (1, 3, 2, 4)), values(rng, (1, 2, 5, 4)),
         values(rng, (1, 2, 5, 4)), {"enable_gqa": True}, None),
    ]
    for name, q, k, v, kwargs, mask in errors:
        try:
            with sdpa_kernel(SDPBackend.MATH):
                scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
        except RuntimeError as exc:
            message = str(exc).splitlines()[0]
        else:
            raise AssertionError(f"{name}: no error")
        cases.append({"name": name, "query": encode(q), "key": encode(k), "value": encode(v),
                      "attn_mask": None if mask is None else encode(mask), "kwargs": kwargs, "error": message})
    return cases


# -- get_total_norm / clip_grads_with_norm_ ----------------------------------------------------
def clip_cases() -> List[Dict[str, Any]]:
    rng = random.Random(20242)  # the draws' order fixes every input: keep it
    inf = float("inf")
    specs: List[Dict[str, Any]] = []
    shapes = [(3, 4), (5,), (2, 2)]
    for norm_type in (2.0, 1.0, inf, 3.0, 0.5):
        for foreach in (None, False, True):
            specs.append({"name": f"norm {norm_type}, foreach={foreach}", "shapes": shapes,
                          "norm_type": norm_type, "foreach": foreach, "max_norm_ratio": 0.4})
    specs += [
        {"name": "no clipping (coefficient clamped to 1)", "shapes": shapes, "norm_type": 2.0, "foreach": None,
         "max_norm_ratio": 5.0},
        {"name": "float32 and float64 grads", "shapes": shapes, "dtypes": ["float32", "float64", "float32"],
         "norm_type": 2.0, "foreach": None, "max_norm_ratio": 0.3},
        {"name": "one tensor, not a list", "shapes": [(4, 3)], "single": True, "norm_type": 2.0, "foreach": None,
         "max_norm_ratio": 0.5},
        {"name": "a parameter without grad", "shapes": shapes, "no_grad": [1], "norm_type": 2.0, "foreach": None,
         "max_norm_ratio": 0.5},
        {"name": "many tensors", "shapes": [(2, 3)] * 12, "norm_type": 2.0, "foreach": None, "max_norm_ratio": 0.7},
        {"name": "bfloat16 grads", "shapes": shapes, "dtypes": ["bfloat16"] * 3, "norm_type": 2.0, "foreach": None,
         "max_norm_ratio": 0.5},
    ]
    cases = []
    for spec in specs:
        dtypes = [DTYPES[d] for d in spec.get("dtypes", ["float32"] * len(spec["shapes"]))]
        params = [torch.nn.Parameter(values(rng, s, dt, 3.0)) for s, dt in zip(spec["shapes"], dtypes)]
        for i, p in enumerate(params):
            if i not in spec.get("no_grad", []):
                p.grad = values(rng, p.shape, p.dtype, 3.0)
        cases.append({"spec": {k: v for k, v in spec.items() if k != "shapes"},
                      "grads": [None if p.grad is None else encode(p.grad) for p in params]})
    return cases


def build() -> Dict[str, Any]:
    meta = {"_doc": "Inputs and error messages, made by tools/reference_values.py with torch " + torch.__version__
            + "; do not edit. No expected values: the tests compute their references in their own run."}
    return {"sdpa.json": {**meta, "cases": sdpa_cases()}, "clip_grads.json": {**meta, "cases": clip_cases()}}


def _dump(content: Dict[str, Any]) -> str:
    """JSON with one case per line (reviewable diffs, small files)."""
    cases = ",\n".join(json.dumps(case, sort_keys=True) for case in content["cases"])
    return f'{{"_doc": {json.dumps(content["_doc"])}, "cases": [\n{cases}\n]}}\n'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if not torch.__version__.startswith(REFERENCE_TORCH + "."):
        print(f"reference values come from torch {REFERENCE_TORCH}; this is torch {torch.__version__}", file=sys.stderr)
        return 2
    files = build()
    stale = []
    for name, content in files.items():
        text = _dump(content)
        path = OUT / name
        if args.write:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif args.check and (not path.exists() or path.read_text() != text):
            stale.append(name)
        print(f"{name}: {len(content['cases'])} cases, {len(text)} bytes")
    if stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

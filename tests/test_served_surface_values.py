"""The names served to complete a served module's surface (issue 42, part 3) are torch 2.15's: each
constant's value, and each helper's results and errors on a few inputs, read here with TORCHPATCH=1 and
natively on torch 2.15 (its matrix venv), in one process each. Only the names the catalogue serves on
this torch and the torch lacks natively (its inventory says) are probed here; on a torch where there
are none, no process is started."""

import json
import math
import sys
from typing import Any

import pytest

from conftest import REPO, TORCH, clean_env, run_json, run_newest_torch_json

sys.path.insert(0, str(REPO / "tools"))
import served_surface  # noqa: E402

from torchpatch._check.serving import Serving  # noqa: E402
from torchpatch._config import Config  # noqa: E402
from torchpatch._registry import builtin_patches  # noqa: E402

HERE = served_surface.installed_inventory(TORCH or "")
SERVED_HERE = Serving.for_torch(TORCH or "", builtin_patches(), Config()).symbols  # (module, name) -> patch

# (module, name, expression over the object ``v``); ``err(f)``: f()'s result or its error's type and
# text; ``kind(f)``: f()'s result or its error's type alone (a text that names numpy's types, which
# depends on numpy being installed).
PROBES = (
    ("torch.nn.attention.flex_attention", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", "v"),
    ("torch.nn.attention.flex_attention", "_WARNINGS_SHOWN", "type(v).__name__"),
    ("torch.nn.attention.flex_attention", "_warn_once", "warned(lambda: (v('tp-x', 'once'), v('tp-x', 'once')))"),
    ("torch.nn.attention.flex_attention", "_ModificationType", "[(m.name, m.value) for m in v]"),
    ("torch.nn.attention.flex_attention", "_get_mod_type",
     "[v(lambda s, b, h, q, k: s).name, v(lambda b, h, q, k: b).name, v(lambda b, h, q, k, x=1: b).name, "
     "err(lambda: v(lambda b, h: b))]"),
    ("torch.nn.attention.flex_attention", "_identity", "v(torch.arange(3.0), 0, 0, 0, 0).tolist()"),
    ("torch.nn.attention.flex_attention", "_round_up_to_multiple", "[v(5, 4), v(8, 4), v(0, 3), v(1, 128)]"),
    ("torch.nn.attention.flex_attention", "_broadcast_to_dim",
     "[list(v(torch.ones(3), 4).shape), list(v(torch.ones(2, 3), 1).shape)]"),
    ("torch.nn.attention.flex_attention", "_sliced_mask_mod_error", "err(lambda: v(0, 0, 0, 0))"),
    *(("torch.distributed.checkpoint.filesystem", name, "v") for name in (
        "CURRENT_DCP_VERSION", "HF_DCP_VERSION", "DCP_VERSION_KEY", "CUSTOM_METADATA_KEY", "FORMAT_KEY",
        "FORMAT_VALUE")),
    *(("torch.distributed.checkpoint._consolidate_hf_safetensors", name, "v") for name in (
        "SUFFIX", "DATA_OFFSETS_KEY", "DEFAULT_EXTRA_METADATA_KEY", "DTYPE_KEY", "SAVED_OFFSETS_KEY", "SHAPE_KEY")),
    *(("torch", name, "[err(lambda: v(True)), err(lambda: v(False)), err(lambda: v(False, 'boom')), "
                      "err(lambda: v(False, lambda: 'lazy')), err(lambda: v(1)), err(lambda: v(torch.tensor(True)))]")
      for name in ("_check", "_check_index", "_check_value", "_check_type", "_check_not_implemented")),
    ("torch", "_check_with", "[err(lambda: v(KeyError, False, 'k')), err(lambda: v(UserWarning, False, 'w')), "
                            "err(lambda: v(KeyError, True, 'k'))]"),
    ("torch", "_check_tensor_all", "[err(lambda: v(torch.tensor([True, True]))), "
                                  "err(lambda: v(torch.tensor([True, False]), 'some')), "
                                  "err(lambda: v(torch.tensor([1]))), "
                                  "err(lambda: v(True))]"),
    ("torch", "_check_tensor_all_with", "err(lambda: v(ValueError, torch.tensor([False])))"),
    ("torch", "sym_max", "[v(1, 2), v(1, 2.5), v(3.0, 1), v(-1, -1.0), kind(lambda: v('a', 1))]"),
    ("torch", "sym_min", "[v(1, 2), v(1, 2.5), v(3.0, 1), kind(lambda: v(1, None))]"),
    ("torch", "sym_not", "[v(True), v(False), v(0), v(3)]"),
    ("torch", "sym_float", "[v(3), v(2.5), v(True)]"),
    ("torch", "sym_int", "[v(2.7), v(-2.7), v(True), kind(lambda: v('x'))]"),
    ("torch", "newaxis", "[v is None, list(torch.ones(2)[:, v].shape)]"),
    ("torch", "unravel_index",
     "[[(str(c.dtype), c.tolist()) for c in v(torch.tensor([4, 1, 7]), (2, 4))], "
     "[c.tolist() for c in v(torch.tensor(5), 6)], "
     "[c.tolist() for c in v(torch.tensor([], dtype=torch.long), (0, 2))], err(lambda: v(torch.tensor([1.0]), (2,))), "
     "err(lambda: v(torch.tensor([1]), (2, -1))), err(lambda: v(torch.tensor([1]), (0, 2))), "
     "err(lambda: v(torch.tensor([1]), 'ab')), err(lambda: v(torch.tensor([1]), 2.0))]"),
    ("torch.distributed", "get_node_local_rank", "local_rank(v)"),
    ("torch.distributed._pycute", "signum", "[v(3), v(0), v(-2)]"),
    ("torch.distributed._pycute", "inner_product",
     "[v((1, (2, 3)), (4, (5, 6))), v(2, 3), kind(lambda: v((1,), (1, 2)))]"),
    ("torch.distributed._pycute", "tuple_max", "[v((1, (7, 3))), v(4)]"),
    ("torch.distributed._pycute", "elem_scale", "[v((2, 3), (4, 5)), v(2, (3, 4)), kind(lambda: v((2,), 3))]"),
    ("torch.distributed._pycute", "shape_div",
     "[v((6, 4), 3), v((4, 6), (2, 3)), v(6, (2, 3)), v(2, 4), kind(lambda: v(6, 4))]"),
    ("torch.distributed._pycute", "crd2crd",
     "[v((1, 2), (2, 3)), v(5, (2, 3)), v((1, 2), 6, (2, 3)), kind(lambda: v(4, 3))]"),
    ("torch.distributed._pycute", "slice_", "[v((None, 1, (None, 2)), (4, 5, (6, 7))), v(None, 3), v(1, 3)]"),
    ("torch.distributed._pycute", "has_none", "[v((1, (None,))), v((1, 2)), v(None)]"),
    ("torch.distributed._pycute", "right_inverse",
     "[lay(v(L((2, 3), (3, 1)))), lay(v(L((4, 2), (1, 8)))), lay(v(4)), v(None)]"),
    ("torch.distributed._pycute", "left_inverse", "[lay(v(L((2, 3), (3, 1)))), lay(v(L(4, 2)))]"),
    ("torch.distributed._pycute", "logical_divide",
     "[lay(v(L(8), L(2))), lay(v(L((4, 6)), (2, 3))), lay(v(L(8), 4)), lay(v(L(8), None))]"),
    ("torch.distributed._pycute", "logical_product",
     "[lay(v(L(4), L(3))), lay(v(L((2, 2)), (L(2), L(3)))), lay(v(L(8), 2))]"),
    *(("torch.distributed._pycute", name,
       "[lay(v(L((4, 6)), (L(2), L(3)))), lay(v(L(8), L(2))), lay(v(L(8), None))]")
      for name in ("zipped_divide", "tiled_divide", "zipped_product", "tiled_product")),
    ("torch.distributed._pycute", "slice_and_offset",
     "[[lay(s), o] for s, o in (v((None, 1), L((2, 3))), v((1, None), L((4, 5), (7, 1))))]"),
    ("torch.nn.functional", "lp_pool3d", "lp_pool(v)"),
    ("torch.nn.functional", "_canonical_mask",
     "[err(lambda: v(torch.tensor([True, False]), 'm', None, 'o', torch.float32).tolist()), "
     "err(lambda: v(torch.tensor([1, 0]), 'm', None, 'o', torch.float32)), "
     "warned(lambda: v(torch.tensor([0.5]), 'm', torch.bool, 'o', torch.float32)), "
     "v(None, 'm', None, 'o', torch.float32)]"),
    ("torch.nn.functional", "_none_or_dtype",
     "[v(None), str(v(torch.ones(1, dtype=torch.float16))), err(lambda: v(3))]"),
    ("torch.nn.functional", "_check_key_padding_mask",
     "[err(lambda: v(torch.ones(2, 3), 3, 2)), err(lambda: v(torch.ones(2, 3), 3, 4)), "
     "err(lambda: v(torch.ones(2, 3), 5, 2))]"),
    ("torch.nn.functional", "_check_unpool_output_size", "[err(lambda: v([1, 2], 1)), err(lambda: v([1, -2], 1))]"),
    ("torch.nn.functional", "_is_integer",
     "[v(3), v(True), v(2.0), v(torch.ones(1, dtype=torch.long)), v(torch.ones(1)), v('3')]"),
    ("torch.nn.functional", "_expand_single_value", "[v(None), v(3), v([1, 2])]"),
    ("torch.nn.functional", "_list_or_empty", "[v(None), v([]), v([1])]"),
    ("torch.nn.functional", "_enum_list_as_int_list", "[v(Pick.A), v([Pick.A, Pick.B])]"),
    ("torch._utils", "is_compiling", "[warned(v), v()]"),
    ("torch._utils", "cpu_count",
     "v() == (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count())"),
    ("torch._utils", "try_import",
     "[v('json') is sys.modules['json'], v('torchpatch_no_such_module') is None, v('colorsys').__name__]"),
    ("torch._utils", "_dummy_type", "[v('Foo').__name__, err(lambda: v('Foo')())]"),
    ("torch.nn.utils", "fuse_linear_bn_eval", "fused_linear_bn(v)"),
    ("torch.nn.utils", "fuse_linear_bn_weights",
     "[(str(w.dtype), str(b.dtype), w.requires_grad, b.requires_grad, b.tolist()) for w, b in ["
     "v(torch.ones(2, 3, dtype=torch.float64), None, torch.zeros(2), torch.ones(2), 0.0, torch.ones(2), torch.ones(2)),"
     "v(torch.ones(2, 3).requires_grad_(False), torch.ones(2), torch.zeros(2), torch.ones(2), 0.0, torch.ones(2) * 2, "
     "torch.zeros(2))]]"),
    ("torch.nn.utils", "convert_conv3d_weight_memory_format",
     "[m[0].weight.is_contiguous(memory_format=torch.channels_last_3d) "
     "for m in [v(torch.nn.Sequential(torch.nn.Conv3d(2, 3, 1), torch.nn.Conv2d(2, 2, 1)), torch.channels_last_3d)]]"),
)

PROGRAM = """
import enum, importlib, json, os, sys, warnings
import torch

Pick = enum.Enum("Pick", "A B")

def err(f):
    try:
        return ["ok", f()]
    except Exception as e:
        return [type(e).__name__, str(e)]

def kind(f):
    try:
        return ["ok", f()]
    except Exception as e:
        return [type(e).__name__]

def warned(f):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f()
    return [(w.category.__name__, str(w.message)) for w in caught]

def fused_linear_bn(v):
    lin = torch.nn.Linear(3, 2)
    bn = torch.nn.BatchNorm1d(2)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(6.0).reshape(2, 3) / 7)
        lin.bias.copy_(torch.tensor([0.5, -1.0]))
        bn.weight.copy_(torch.tensor([2.0, 0.5]))
        bn.bias.copy_(torch.tensor([0.25, 1.0]))
        bn.running_mean.copy_(torch.tensor([0.1, -0.2]))
        bn.running_var.copy_(torch.tensor([1.5, 0.5]))
    training = err(lambda: v(lin, bn))
    lin.eval(), bn.eval()
    fused = v(lin, bn)
    x = torch.arange(12.0).reshape(4, 3) / 5
    gap = (fused(x) - bn(lin(x))).abs().max().item()  # the reference: the two modules, in this run
    mismatch = err(lambda: v(torch.nn.Linear(3, 4).eval(), torch.nn.BatchNorm1d(2).eval()))
    return [training, gap < 1e-6, fused is not lin, fused.weight.tolist(), fused.bias.tolist(),
            fused.weight.requires_grad, mismatch]

def L(*args):
    return importlib.import_module("torch.distributed._pycute").Layout(*args)

def lay(layout):
    return [layout.shape, layout.stride]

def local_rank(v):
    unset = [err(lambda: v()), v(3), v(fallback_rank="2")]
    os.environ["LOCAL_RANK"] = "5"
    try:
        return unset + [v(), v(1)]
    finally:
        del os.environ["LOCAL_RANK"]

def lp_pool(v):
    out = []
    for p, kernel, stride in ((2, 2, None), (3, (2, 1, 2), 1), (1.5, 3, (1, 2, 1)), (float("inf"), 2, None),
                              (-float("inf"), 2, 1)):
        x = (torch.arange(128.0).reshape(2, 1, 4, 4, 4) / 50 + 0.1).requires_grad_()
        y = v(x, p, kernel, stride)
        y.sum().backward()
        out.append([list(y.shape), y.flatten().tolist(), x.grad.flatten().tolist()])
    return out + [err(lambda: v(torch.ones(1, 1, 2, 2, 2), 0, 2))]

out = {}
for module, name, expression in json.loads(PROBES):
    try:
        v = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        continue
    out[f"{module}.{name}"] = eval(expression, {**globals(), "v": v})
print(json.dumps(out))
"""


def program(probes: Any) -> str:
    return f"PROBES = {json.dumps(json.dumps(list(probes)))}\n" + PROGRAM


def close(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-6 (the fused weights: one rsqrt may round differently across torch builds)."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def test_served_names_have_torch_215s_values_and_behaviour():
    if HERE is None:
        pytest.skip(f"torch {TORCH} has no inventory: which names it has natively is not known")
    served = [p for p in PROBES if (p[0], p[1]) in SERVED_HERE and p[1] not in HERE.modules.get(p[0], ())]
    if not served:
        pytest.skip(f"torchpatch serves none of the probed names on torch {TORCH}")
    here = run_json(program(served), env=clean_env(TORCHPATCH="1"), timeout=300)
    assert sorted(here) == sorted(f"{m}.{n}" for m, n, _ in served), "served names missing with TORCHPATCH=1"
    newest = run_newest_torch_json(program(PROBES))  # all of them: computed once per checkout, for every torch
    differ = {name: (value, newest[name]) for name, value in here.items() if not close(value, newest[name])}
    assert differ == {}, f"torch {TORCH} (TORCHPATCH=1) vs torch 2.15: (here, 2.15)"

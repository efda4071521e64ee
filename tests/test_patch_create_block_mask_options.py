"""create-block-mask-options: ``create_block_mask``'s torch 2.15 options on torch 2.9.

One process builds causal and sliding-window block masks (128-token blocks over 384 x 256 tokens, one and
two heads) on the CPU with ``separate_full_blocks`` True and False, ``_compile`` off and on (on only where
the patch applies: after its range eager builds show torch's own function untouched), and one
with ``device`` left to its default (the current accelerator, else the CPU), and reports every field of each ``BlockMask`` (block counts, indices, full blocks, sizes,
device) and the error of ``dq_kv_order="yes"``. With TORCHPATCH=1 on torch 2.9 the report must equal
what torch 2.15 reports natively (run in its venv by the same test); natively 2.9 raises ``TypeError``
for ``separate_full_blocks``. Where the patch applies, ``compute_dq_write_order=True`` raises its
``NotImplementedError``.
"""

import json

from conftest import (clean_env, patch_applies_here, run_json, run_newest_torch_json, through_patch_range,
                      where_patch_applies)

SCRIPT = """
import json, torch
from torch.nn.attention.flex_attention import create_block_mask

def causal(b, h, q, kv):
    return q >= kv

def window(b, h, q, kv):
    return (q >= kv) & (q - kv < 150)

def fields(mask):
    out = {"block_size": list(mask.BLOCK_SIZE), "seq_lengths": list(mask.seq_lengths), "device": str(mask.kv_indices.device)}
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        value = getattr(mask, name)
        out[name] = None if value is None else value.tolist()
    return out

out = {}
try:
    for name, mod in (("causal", causal), ("window", window)):
        for heads in (1, 2):
            for separate in (True, False):
                for compiled in COMPILED:  # set by the test ahead of this script
                    mask = create_block_mask(mod, 1, heads, 384, 256, device="cpu", separate_full_blocks=separate,
                                             _compile=compiled)
                    out[f"{name}-{heads}-{separate}-{compiled}"] = fields(mask)
    try:
        create_block_mask(causal, 1, 1, 256, 256, device="cpu", dq_kv_order="yes")
    except ValueError as exc:
        out["dq_kv_order"] = str(exc)
    expected = torch.device(torch.accelerator.current_accelerator() or "cpu")
    try:  # a CUDA build without a GPU names CUDA and cannot use it
        device = create_block_mask(causal, 1, 1, 256, 256, separate_full_blocks=False).kv_indices.device
        out["default_device"] = "the current accelerator, else the CPU" if device.type == expected.type else str(device)
    except RuntimeError as exc:
        out["default_device"] = "the current accelerator, else the CPU" if expected.type != "cpu" else str(exc)
except TypeError as exc:
    out = {"error": "TypeError" if "separate_full_blocks" in str(exc) else str(exc)}
print(json.dumps(out))
"""

DQ_WRITE_ORDER = """
import json
from torch.nn.attention.flex_attention import create_block_mask
try:
    create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 256, 256, device="cpu", compute_dq_write_order=True)
    print(json.dumps("built"))
except NotImplementedError as exc:
    print(json.dumps("NotImplementedError" if "compute_dq_write_order" in str(exc) else str(exc)))
"""




def script(compiled: tuple) -> str:
    """SCRIPT building with ``_compile`` in ``compiled`` (set after its first line: the suite's fork server
    forks a script that imports torch first)."""
    return SCRIPT.replace("import json, torch\n", f"import json, torch\nCOMPILED = {compiled!r}\n", 1)


@where_patch_applies("create-block-mask-options", "create_block_mask has no separate_full_blocks")
def test_native_refuses_the_options():
    assert run_json(script((False, True)), env=clean_env()) == {"error": "TypeError"}


@through_patch_range("create-block-mask-options", "create_block_mask's options")
def test_block_masks_as_the_newest_torch_builds_them():
    # compiled builds (inductor: most of the test's time) where the patch applies; after its range the
    # eager builds show that TORCHPATCH=1 leaves torch's own create_block_mask as it is
    built = script((False, True) if patch_applies_here("create-block-mask-options") else (False,))
    here = run_json(built, env=clean_env(TORCHPATCH="1"), timeout=600)
    newest = run_newest_torch_json(built)
    assert set(here) == set(newest)
    for key in newest:
        assert here[key] == newest[key], (key, json.dumps(here[key])[:500], json.dumps(newest[key])[:500])


@where_patch_applies("create-block-mask-options", "no dq write order before torch 2.10")
def test_dq_write_order_raises():
    assert run_json(DQ_WRITE_ORDER, env=clean_env(TORCHPATCH="1")) == "NotImplementedError"

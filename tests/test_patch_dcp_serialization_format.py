"""dcp-serialization-format: ``filesystem.SerializationFormat`` and
``FileSystemWriter(serialization_format=...)`` on torch 2.4-2.7.

One script saves through ``FileSystemWriter(path, serialization_format=SerializationFormat.TORCH_SAVE)``,
loads back and compares bitwise; it runs served where the patch applies and natively on torch >= 2.8.
Where it applies, ``SAFETENSORS`` raises ``NotImplementedError`` naming the served HF writer.
"""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

USE = """
import json, sys, warnings, torch, torchpatch
warnings.simplefilter("ignore")
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
torch.manual_seed(0)
saved = {"w": torch.randn(3, 2), "n": torch.arange(4)}
dcp.save(saved, storage_writer=FileSystemWriter(sys.argv[1], serialization_format=SerializationFormat.TORCH_SAVE))
loaded = {k: torch.zeros_like(v) for k, v in saved.items()}
dcp.load(loaded, checkpoint_id=sys.argv[1])
print(json.dumps({"equal": all(torch.equal(loaded[k], saved[k]) for k in saved),
                  "members": {m.name: m.value for m in SerializationFormat},
                  "status": torchpatch.status().get("dcp-serialization-format")}))
"""

MEMBERS = {"TORCH_SAVE": "torch_save", "SAFETENSORS": "safetensors"}


@where_patch_applies("dcp-serialization-format", "torch 2.8 added SerializationFormat")
def test_native_failure():
    proc = run_py("from torch.distributed.checkpoint.filesystem import SerializationFormat")
    assert "ImportError: cannot import name 'SerializationFormat'" in proc.stderr


@where_patch_applies("dcp-serialization-format")
def test_served(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "c"),))
    assert out == {"equal": True, "members": MEMBERS, "status": "applied"}
    proc = run_py(
        """
        import sys
        from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat
        FileSystemWriter(sys.argv[1], serialization_format=SerializationFormat.SAFETENSORS)
        """,
        env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "s"),),
    )
    assert proc.returncode != 0 and "NotImplementedError" in proc.stderr and "HuggingFaceStorageWriter" in proc.stderr


@only_torch(">=2.8", "torch's own SerializationFormat: the same results, nothing served")
def test_native(tmp_path):
    out = run_json(USE, env=clean_env(TORCHPATCH="1"), args=(str(tmp_path / "c"),))
    assert out == {"equal": True, "members": MEMBERS, "status": None}

"""dcp-bytes-io-write-data: ``planner.BytesIOWriteData`` and ``WriteItem(bytes_io_data=...)`` on
torch 2.4-2.7.

One script builds ``WriteItem``s carrying ``BytesIOWriteData`` by keyword and positionally (2.8's
order), and one without; it runs served where the patch applies and natively on torch >= 2.8.
"""

from conftest import clean_env, only_torch, run_json, run_py, where_patch_applies

USE = """
import dataclasses, json, torch, torchpatch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import BytesIOWriteData, WriteItem, WriteItemType
data = BytesIOWriteData(nbytes=12)
by_keyword = WriteItem(index=MetadataIndex("extra"), type=WriteItemType.BYTE_IO, bytes_io_data=data)
positional = WriteItem(MetadataIndex("extra"), WriteItemType.BYTE_IO, data, None)
plain = WriteItem(index=MetadataIndex("w"), type=WriteItemType.TENSOR)
try:
    data.nbytes = 3
    frozen = False
except dataclasses.FrozenInstanceError:
    frozen = True
print(json.dumps({"keyword": by_keyword.bytes_io_data.nbytes, "positional": positional.bytes_io_data.nbytes,
                  "tensor_data": positional.tensor_data, "plain": plain.bytes_io_data, "frozen": frozen,
                  "equal": BytesIOWriteData(12) == data,
                  "status": torchpatch.status().get("dcp-bytes-io-write-data")}))
"""

EXPECTED = {"keyword": 12, "positional": 12, "tensor_data": None, "plain": None, "frozen": True, "equal": True}


@where_patch_applies("dcp-bytes-io-write-data", "torch 2.8 added BytesIOWriteData")
def test_native_failure():
    proc = run_py("from torch.distributed.checkpoint.planner import BytesIOWriteData")
    assert "ImportError: cannot import name 'BytesIOWriteData'" in proc.stderr


@where_patch_applies("dcp-bytes-io-write-data")
def test_served():
    assert run_json(USE, env=clean_env(TORCHPATCH="1")) == dict(EXPECTED, status="applied")


@only_torch(">=2.8", "torch's own BytesIOWriteData: the same results, nothing served")
def test_native():
    assert run_json(USE, env=clean_env(TORCHPATCH="1")) == dict(EXPECTED, status=None)

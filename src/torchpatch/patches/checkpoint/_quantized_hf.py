"""torch 2.9+'s ``QuantizedHuggingFaceStorageReader``: a Hugging Face safetensors reader that
dequantizes while it reads. FP8 block quantization (``X.weight`` with ``X.weight_scale_inv``: each
``block_size`` x ``block_size`` block of the 2-D weight times its scale) and MXFP4 (``X_blocks``
with ``X_scales``: 4-bit values in ``[..., groups, bytes]``, scaled by ``2 ** (scale - 127)``)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Tuple

MODULE = "torch.distributed.checkpoint.quantized_hf_storage"
_SCALE_SUFFIXES = (".weight_scale_inv", "_scales")
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

logger = logging.getLogger(MODULE)


def scale_names(weight_map: Dict[str, str]) -> Dict[str, str]:
    """Each quantized tensor's scale tensor, among the names of an index file's ``weight_map``."""
    pairs = {}
    for name in weight_map:
        if name.endswith(".weight_scale_inv"):
            quantized = name[: -len("_scale_inv")]
        elif name.endswith("_scales"):
            quantized = name[: -len("_scales")] + "_blocks"
        else:
            continue
        if quantized in weight_map:
            pairs[quantized] = name
    return pairs


def dequantize_blocks(weight: Any, scale_inv: Any, offsets: Tuple[int, int], block_size: int, dtype: Any) -> Any:
    """The region of an FP8 block-quantized 2-D weight starting at ``offsets``, each element times
    the scale of its block (computed in float32, as torch does: float8 has no CPU multiply)."""
    import torch

    rows = torch.arange(offsets[0], offsets[0] + weight.shape[0]) // block_size
    cols = torch.arange(offsets[1], offsets[1] + weight.shape[1]) // block_size
    scale = scale_inv[rows][:, cols].to(torch.float32)
    return (weight.to(torch.float32) * scale).to(dtype)


def dequantize_mxfp4(blocks: Any, exponents: Any, first: int, length: int, dtype: Any) -> Any:
    """MXFP4 ``blocks`` ``[..., groups, bytes]`` (two 4-bit values a byte, low nibble first) scaled by
    ``2 ** (exponents - 127)`` (``exponents`` ``[..., groups]``), as ``[..., groups * bytes * 2]``;
    values ``first`` to ``first + length`` of the last dimension."""
    import torch

    lut = torch.tensor(_FP4_VALUES, dtype=dtype)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)
    values = torch.ldexp(values, exponents.to(torch.int32).unsqueeze(-1) - 127).to(dtype)
    return values.reshape(*blocks.shape[:-2], -1)[..., first:first + length]


def make_reader(base: type) -> type:
    """The quantized reader class on ``base``, a ``HuggingFaceStorageReader`` with 2.9+'s API."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ._hf_safetensors import INDEX_FILE, copy_to_target

    class QuantizedHuggingFaceStorageReader(base):  # type: ignore[misc, valid-type]
        """A ``HuggingFaceStorageReader`` that dequantizes FP8 block-quantized and MXFP4 tensors
        as it reads them. A quantized tensor must be whole in one safetensors file."""

        def __init__(self, path: str, thread_count: int = 1, target_dtype: torch.dtype = torch.float32,
                     block_size: int = 128) -> None:
            super().__init__(path=path, thread_count=thread_count)
            self.target_dtype = target_dtype
            self.block_size = block_size
            self._weight_scale_mapping: Dict[str, str] = {}
            self._weight_map: Dict[str, str] = {}
            self._tensor_full_shapes: Dict[str, torch.Size] = {}

        def read_metadata(self) -> Any:
            metadata = super().read_metadata()
            with open(os.path.join(str(self.path), INDEX_FILE)) as index:
                self._weight_map = json.load(index).get("weight_map", {})
            self._weight_scale_mapping = scale_names(self._weight_map)
            for fqn, md in metadata.state_dict_metadata.items():
                if not isinstance(md, TensorStorageMetadata):
                    continue
                if fqn.endswith("_blocks"):  # MXFP4: planned as its dequantized shape
                    self._tensor_full_shapes[fqn + "_quantized"] = md.size
                    *prefix, groups, width = md.size
                    md.size = torch.Size([*prefix, groups * width * 2])
                self._tensor_full_shapes[fqn] = md.size
            return metadata

        def _is_tensor_quantized(self, tensor_fqn: str) -> bool:
            return not tensor_fqn.endswith(_SCALE_SUFFIXES) and tensor_fqn in self._weight_scale_mapping

        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            if not self._is_tensor_quantized(req.storage_index.fqn):
                return super()._process_read_request(f, req, planner)
            try:
                tensor = self._read_dequantized(f, req)
            except Exception:
                logger.error("Failed to read the quantized tensor!!")
                raise
            copy_to_target(tensor, req, planner)

        def _read_scale(self, f: Any, fqn: str, scale_fqn: str) -> torch.Tensor:
            scale_file = self._weight_map.get(scale_fqn)
            if scale_file is None:
                raise ValueError(f"Scale tensor {scale_fqn} not found in weight_map")
            if scale_file == self._weight_map.get(fqn):
                return f.get_tensor(scale_fqn)
            from safetensors import safe_open

            with safe_open(os.path.join(str(self.path), scale_file), framework="pt", device="cpu") as other:
                return other.get_tensor(scale_fqn)

        def _read_dequantized(self, f: Any, req: Any) -> torch.Tensor:
            fqn = req.storage_index.fqn
            offsets, lengths = list(req.storage_offsets), list(req.lengths)
            first = group_start = 0
            if fqn.endswith("_blocks"):
                # the request is in dequantized coordinates [..., groups * width * 2]: read whole groups
                width = self._tensor_full_shapes[fqn + "_quantized"][-1]
                if len(offsets) != 3:
                    raise AssertionError
                group_start = offsets[2] // (width * 2)
                group_end = (offsets[2] + lengths[2] + width * 2 - 1) // (width * 2)
                first = offsets[2] - group_start * width * 2
                slices = (slice(offsets[0], offsets[0] + lengths[0]), slice(offsets[1], offsets[1] + lengths[1]),
                          slice(group_start, group_end), slice(None))
            else:
                slices = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            quantized = f.get_slice(fqn)[slices]
            scale = self._read_scale(f, fqn, self._weight_scale_mapping[fqn])
            full_shape = self._tensor_full_shapes.get(fqn)
            if full_shape is None:
                raise ValueError(f"Could not find full tensor shape for {fqn}")
            if len(full_shape) == 2:
                return dequantize_blocks(quantized, scale, (offsets[0], offsets[1]), self.block_size, self.target_dtype)
            if fqn.endswith("_blocks"):
                exponents = scale[slices[0], slices[1], group_start:group_start + quantized.shape[2]]
                if quantized.shape[:-1] != exponents.shape:
                    raise AssertionError(f"blocks.shape={quantized.shape} does not match scales.shape={exponents.shape}")
                return dequantize_mxfp4(quantized, exponents, first, lengths[2], self.target_dtype)
            raise ValueError("Unsupported quantization types")

    QuantizedHuggingFaceStorageReader.__module__ = MODULE
    return QuantizedHuggingFaceStorageReader

"""The Hugging Face safetensors storage writer and reader of torch 2.9+'s
``torch.distributed.checkpoint.hf_storage``, on the installed ``FileSystemWriter``/``FileSystemReader``
(served by dcp-hf-storage). Same files as torch 2.9+: ``model-0000i-of-0000N.safetensors`` (with
``save_distributed``: ``shard-0000r-model-...``) whose ``__metadata__`` holds ``DCP_SHARDING_INFO``
(each tensor's ``saved_offsets``), ``DCP_VERSION`` and ``format``, and
``model.safetensors.index.json`` (``total_size``, ``weight_map``)."""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

MODULE = "torch.distributed.checkpoint.hf_storage"
INDEX_FILE = "model.safetensors.index.json"
SUFFIX = ".safetensors"
SHARDING_INFO = "DCP_SHARDING_INFO"
SHARDED_DIR = "sharded"


@dataclasses.dataclass
class _HFStorageInfo:
    """Where one saved chunk is: its file, shape and dtype."""

    relative_path: str
    shape: Any
    dtype: Any


def _file_name(index: int, largest: int, shard: Optional[int] = None) -> str:
    name = f"model-{index:05d}-of-{largest:05d}{SUFFIX}"
    return name if shard is None else f"shard-{shard:05d}-{name}"


def _safetensors_files(directory: str) -> List[str]:
    return sorted(os.path.join(directory, name) for name in os.listdir(directory) if name.endswith(SUFFIX))


def _write_index(directory: str, weight_map: Dict[str, str], total_size: int) -> None:
    with open(os.path.join(directory, INDEX_FILE), "w") as index:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": weight_map}, index, indent=2)


def consolidate_files(input_dir: str, output_dir: str, fqn_to_index: Dict[str, int],
                      largest: Optional[int] = None) -> Dict[str, Tuple[str, int]]:
    """Assemble the full tensors of the names ``fqn_to_index`` maps from the shard files of
    ``input_dir`` (in memory) and write them to ``output_dir``, one file per index (``largest``: the
    highest index of the whole model, where ``fqn_to_index`` is a part of it); the other names in the
    shard files are left out. Returns name -> (its file, its bytes), what the index file lists."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    pieces: Dict[str, List[Tuple[List[int], Any]]] = {}
    for path in _safetensors_files(input_dir):
        with safe_open(path, framework="pt") as f:
            info = json.loads((f.metadata() or {}).get(SHARDING_INFO, "{}"))
            for key in f.keys():
                if key not in fqn_to_index:
                    continue
                tensor = f.get_tensor(key)
                offsets = info.get(key, {}).get("saved_offsets", [0] * tensor.dim())
                pieces.setdefault(key, []).append((offsets, tensor))
    largest = max(fqn_to_index.values()) if largest is None else largest
    files: Dict[int, Dict[str, Any]] = {}
    for key, chunks in pieces.items():
        size = [max(off[d] + t.shape[d] for off, t in chunks) for d in range(chunks[0][1].dim())]
        full = torch.empty(size, dtype=chunks[0][1].dtype)
        for offsets, tensor in chunks:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))] = tensor
        files.setdefault(fqn_to_index[key], {})[key] = full
    written: Dict[str, Tuple[str, int]] = {}
    for index, tensors in files.items():
        name = _file_name(index, largest)
        save_file(tensors, os.path.join(output_dir, name))
        written.update((key, (name, tensor.numel() * tensor.element_size())) for key, tensor in tensors.items())
    return written


def write_index(directory: str, written: Dict[str, Tuple[str, int]]) -> None:
    """``model.safetensors.index.json`` of what :func:`consolidate_files` wrote."""
    _write_index(directory, {key: name for key, (name, _) in written.items()},
                 sum(size for _, size in written.values()))


def _consolidate(input_dir: str, output_dir: str, fqn_to_index: Dict[str, int]) -> None:
    """Assemble every name of ``fqn_to_index`` into ``output_dir``'s model files, with the index file."""
    write_index(output_dir, consolidate_files(input_dir, output_dir, fqn_to_index))


def copy_to_target(tensor: Any, req: Any, planner: Any) -> None:
    """Copy ``tensor``, read for ``req``, into the planner's target tensor and commit it."""
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)


def make_classes() -> Tuple[type, type]:
    """``(HuggingFaceStorageReader, HuggingFaceStorageWriter)`` on the installed file-system ones."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    def done(value: Any) -> Future:
        future: Future = Future()
        future.set_result(value)
        return future

    class HuggingFaceStorageWriter(FileSystemWriter):
        """A writer that writes to storage in the huggingface safetensors format."""

        def __init__(self, path: str, fqn_to_index_mapping: Optional[Dict[str, int]] = None, thread_count: int = 1,
                     save_distributed: bool = False, enable_consolidation: bool = False,
                     thread_count_consolidation: int = 1) -> None:
            super().__init__(path=path, thread_count=thread_count)
            self.fqn_to_index_mapping = fqn_to_index_mapping
            self.save_distributed = save_distributed
            self.enable_consolidation = enable_consolidation
            self.consolidated_output_path: Optional[str] = None
            if enable_consolidation:
                self.consolidated_output_path = str(self.path)
                self.path = self.fs.concat_path(self.path, SHARDED_DIR)
            self.thread_count_consolidation = thread_count_consolidation

        def prepare_global_plan(self, plans: List[Any]) -> List[Any]:
            new_plans = []
            for rank, plan in enumerate(plans, start=1):
                storage_data: Dict[str, Any] = {}
                if self.fqn_to_index_mapping is not None:
                    storage_data["fqn_to_index_mapping"] = self.fqn_to_index_mapping
                if self.save_distributed:
                    storage_data["shard_index"] = rank
                new_plans.append(dataclasses.replace(plan, storage_data=storage_data))
            return new_plans

        def write_data(self, plan: Any, planner: Any) -> Future:
            if not plan.items:
                return done([])
            mapping = plan.storage_data.get("fqn_to_index_mapping")
            shard = plan.storage_data.get("shard_index")
            buckets: Dict[int, List[Any]] = {}
            for item in plan.items:
                buckets.setdefault(mapping[item.index.fqn] if mapping is not None else 1, []).append(item)
            largest = max(mapping.values()) if mapping is not None else 1
            results: List[Any] = []
            for index, items in buckets.items():
                results += self._write_file(_file_name(index, largest, shard), items, planner)
            return done(results)

        def _write_file(self, name: str, items: List[Any], planner: Any) -> List[Any]:
            from safetensors.torch import save

            tensors, offsets, results = {}, {}, []
            for item in items:
                if item.type == WriteItemType.BYTE_IO:
                    raise ValueError(f"HuggingFaceStorageWriter writes tensors only; {item.index.fqn!r} is not one")
                tensor = planner.resolve_data(item).detach().cpu().contiguous()
                tensors[item.index.fqn] = tensor
                offsets[item.index.fqn] = {"saved_offsets": list(item.tensor_data.chunk.offsets)}
                length = tensor.numel() * tensor.element_size()
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(relative_path=name, offset=0, length=length)))
            payload = save(tensors, metadata={SHARDING_INFO: json.dumps(offsets), "DCP_VERSION": "1.0",
                                              "format": "pt"})
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
                stream.write(payload)
                if self.sync_files:
                    stream.flush()
                    os.fsync(stream.fileno())
            return results

        def finish(self, metadata: Any, results: List[List[Any]]) -> None:
            if self.save_distributed and not self.enable_consolidation:
                return  # no index: each tensor is spread over the ranks' files
            if self.save_distributed:
                mapping = self.fqn_to_index_mapping or dict.fromkeys(metadata.state_dict_metadata, 1)
                _consolidate(str(self.path), str(self.consolidated_output_path), mapping)
                return
            written = [result for per_rank in results for result in per_rank]
            _write_index(str(self.path), {r.index.fqn: r.storage_data.relative_path for r in written},
                         sum(r.storage_data.length for r in written))

        @property
        def metadata_path(self) -> Any:
            return self.fs.concat_path(self.path, INDEX_FILE)

    class HuggingFaceStorageReader(FileSystemReader):
        """A reader that reads a checkpoint in the huggingface safetensors format."""

        def __init__(self, path: str, thread_count: int = 1) -> None:
            super().__init__(path=path)
            self.thread_count = thread_count

        def _read_file(self, path: str, requests: List[Any], planner: Any) -> None:
            from safetensors import safe_open

            with safe_open(filename=path, framework="pt") as f:
                for req in requests:
                    self._process_read_request(f, req, planner)

        def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
            """Copy the region ``req`` names from the open safetensors file ``f`` into its target."""
            slices = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
            copy_to_target(f.get_slice(req.storage_index.fqn)[slices], req, planner)

        def read_data(self, plan: Any, planner: Any) -> Future:
            per_file: Dict[str, List[Any]] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            with ThreadPoolExecutor(max_workers=max(1, min(self.thread_count, len(per_file)))) as pool:
                for future in [pool.submit(self._read_file, path, reqs, planner) for path, reqs in per_file.items()]:
                    future.result()
            return done(None)

        def read_metadata(self) -> Any:
            from safetensors import safe_open
            from safetensors.torch import _getdtype

            state_dict_metadata: Dict[str, Any] = {}
            storage_data: Dict[Any, Any] = {}
            for path in _safetensors_files(str(self.path)):
                with safe_open(path, framework="pt") as f:
                    info = json.loads((f.metadata() or {}).get(SHARDING_INFO, "null"))
                    for key in f.keys():
                        shape = f.get_slice(key).get_shape()
                        dtype = _getdtype(f.get_slice(key).get_dtype())
                        offset = info[key]["saved_offsets"] if info is not None else [0] * len(shape)
                        chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
                        end = [o + n for o, n in zip(offset, shape)]
                        md = state_dict_metadata.get(key)
                        if md is None:
                            state_dict_metadata[key] = TensorStorageMetadata(
                                properties=TensorProperties(dtype=dtype), size=torch.Size(end), chunks=[chunk])
                        else:
                            md.chunks.append(chunk)
                            md.size = torch.Size(max(a, b) for a, b in zip(md.size, end))
                        storage_data[MetadataIndex(fqn=key, offset=torch.Size(offset))] = _HFStorageInfo(
                            relative_path=path, shape=torch.Size(shape), dtype=dtype)
            metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    for cls in (HuggingFaceStorageReader, HuggingFaceStorageWriter):
        cls.__module__ = MODULE
    return HuggingFaceStorageReader, HuggingFaceStorageWriter

"""Tensor parallel: ``torch.distributed.tensor.parallel`` (``parallelize_module`` and its styles)."""

"""The launcher: ``torchrun`` (``torch.distributed.run``, ``torch.distributed.elastic``)."""

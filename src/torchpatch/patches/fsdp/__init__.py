"""FSDP: ``torch.distributed.fsdp`` (FSDP1) and FSDP2 (``fully_shard``)."""

"""``torch.distributed.device_mesh`` (``DeviceMesh``, ``init_device_mesh``)."""

"""Pipeline parallel: ``torch.distributed.pipelining`` (stages, schedules, their runtime)."""

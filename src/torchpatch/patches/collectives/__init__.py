"""c10d and the functional collectives: ``torch.distributed`` (ProcessGroup, gloo), ``torch.distributed._functional_collectives``, ``torch.ops._c10d_functional``."""

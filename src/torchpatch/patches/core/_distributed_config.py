"""The code of ``torch.distributed.config`` as the distributed-config patch serves it on torch
2.4-2.10: torch 2.15's flags, each off; ``install_config_module`` (run by the patch) makes it a config
module like torch's. Nothing in these torch versions reads the flags: the patch refuses to turn one on."""

# Trace and compile on one rank only (torch 2.15: an alias of torch.compiler.config.compile_on_one_rank).
compile_on_one_rank: bool = False

# Use the TorchComms communication backend instead of the ProcessGroup backends (NCCL, Gloo, ...).
use_torchcomms: bool = False

# Give each directed pair of pipeline ranks its own communicator for P2P.
pipeline_per_edge_p2p: bool = False

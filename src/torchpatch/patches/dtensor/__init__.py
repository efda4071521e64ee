"""DTensor: ``torch.distributed.tensor`` (placements, sharding propagation, redistribution, random)."""

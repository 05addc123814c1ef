class CheckpointError(ValueError):
    """A checkpoint we cannot load; the message names the file and tensor (or shard)."""

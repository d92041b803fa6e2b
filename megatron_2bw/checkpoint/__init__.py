from megatron_2bw.checkpoint.save_load import (CheckpointError, load_checkpoint,  # noqa: F401
                                               maybe_load_checkpoint, read_metadata, save_checkpoint,
                                               saved_config)

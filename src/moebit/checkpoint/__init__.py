"""Checkpoints: ``files`` holds the atomic, code-free file layer (shards, manifests, which
checkpoint is newest and complete); ``weights`` loads a checkpoint's model weights at any
expert-parallel degree. Saving and restoring a whole training run (optimizer, data stream,
RNG) is the loop's: ``moebit.training.state``.

Only the file layer is re-exported here: reading a manifest must not import the models.
"""

from moebit.checkpoint.files import (
    MANIFEST,
    CheckpointError,
    latest,
    list_complete,
    load_file,
    prune,
    read_manifest,
    remove_incomplete,
    save_atomic,
    sha256_of,
    shard_name,
    step_dir,
    verify,
    write_manifest,
    write_text_atomic,
)

__all__ = [
    "MANIFEST", "CheckpointError", "latest", "list_complete", "load_file", "prune",
    "read_manifest", "remove_incomplete", "save_atomic", "sha256_of", "shard_name", "step_dir", "verify",
    "write_manifest", "write_text_atomic",
]

"""The KV cache scan: a slot's saved state (or the engine's own cache) read back cell by cell, and the damage it
shows (duplicate cells, orphans past the sequence, holes; `scan`), which `kv-healthy` judges and `specharness
kvscan` prints."""

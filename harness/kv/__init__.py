"""The KV cache scan: a slot's saved state (or the engine's own cache) read back cell by cell, and the damage it
shows (duplicate cells, orphans past the sequence, holes; `scan`), which `kv-healthy` judges and `specharness
kvscan` prints.

- `scan`: `scan_bytes` / `scan_file` and a model's known layout (`layout_from_model`);
- `parse`: reading a blob's framing and its KV and recurrent sections under each hypothesis of its layout;
- `report`: what a scan finds (`Layout`, `Part`, `ScanReport`)."""

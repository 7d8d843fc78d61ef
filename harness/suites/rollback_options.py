"""The in-process engine's rollback options as suites and the command line name them. A neutral module (no
llama_cpp), so the suite loader, and the reports that read suites, need not import the engine (the import
contracts in pyproject.toml; docs/architecture.md)."""

STRATEGIES = ("auto", "seq-rm", "checkpoint", "partial")
"""`rollback`: how a sequence's memory goes back after rejected drafts (harness.engine.rollback)."""

CHECKPOINT_KINDS = ("partial", "full")
"""`checkpoint_flags`: what a checkpoint saves (PARTIAL_ONLY, the recurrent state; or the whole sequence)."""

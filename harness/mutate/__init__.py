"""Mutation testing of llama.cpp's speculative code (`specharness mutate`): what share of the bugs one could write into
it the harness catches.

- `targets`: which files and lines are mutated (the speculative path by default; log-only lines never);
- `generate`: the mutants (universalmutator's C++ rules) and a seeded sample;
- `tree`: the cache's copy of the tree that one mutant at a time is written into, always restored;
- `battery`: the suites a mutant build meets, stage by stage, each as `specharness run` in its own process;
- `campaign`: the plan, the per-mutant record and the procedure; `score`: the score, its interval and the report;
- `cli`: the command.
"""

from harness.mutate.generate import Mutant

__all__ = ["Mutant"]

"""`specharness bisect`: the llama.cpp commit (or llama-cpp-python release) that made a pinned case fail.

Modules: `plan` (the pinned cell), `judge` (checks and triage decide good / bad / skip), `step` (one
`git bisect run` step: build, judge, log), `driver` (git bisect start/run/reset, interrupts, resume),
`releases` (`--releases A..B` over vendored trees), `result` (summary, bisect.json, bisect.html).
"""

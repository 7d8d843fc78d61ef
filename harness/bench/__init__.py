"""`specharness bench`: speed numbers measured on this machine, never asserted in tests.

Modules: `speed` (the default: speculative speed and acceptance per prompt category, engines and
speculative configs side by side, interleaved, median and spread over repeats), `costs` (what the
harness itself costs: time outside `llama_decode`, logit logging, KV scans, state copies, a suite's
wall time against its inference time), `builds` (incremental llama-server builds), `reportload`
(size and browser load time of a large HTML report), `page` (`bench.json` and `bench.html`), `cli`.
"""

"""`specharness shrink`: delta debugging of a failing case while the same failure signature still fails.

Modules: `candidate` (the case under reduction and how it is served: one frozen value per step), `ddmin`
(Zeller's ddmin over a list, the smallest failing integer), `trial` (run a candidate on the same backend and
build, evaluate the failing check, its signatures; k of n for a nondeterministic failure), `driver` (the
passes, progress, Ctrl-C keeps the smallest case), `cli`. The reproducer bundle it writes is `harness.repro`.
"""

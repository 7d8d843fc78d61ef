"""The commands that sit on top (`specharness run`, `calibrate`, `selftest`, `init`, `kvscan`); only
harness.cli imports them (the import contract `commands-on-top`). The capabilities with their own packages
(report/, bisect/, bench/, shrink/, repro/, models/) keep their command in their own `cli` module."""

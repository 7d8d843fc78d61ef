"""A command stopped by an exception of the harness itself exits 3 (a harness error), as `run`'s harness faults do:
exit 1 is a verdict (failing checks for `run`, an unhealthy cache for `scan`), and a caller that reads it (`repro.sh`,
CI, bisect) must not take a traceback for one."""

from __future__ import annotations

from harness import cli
from harness.commands import kvscan


def test_a_bug_in_a_command_exits_3_with_its_traceback_not_1(tmp_path, monkeypatch, capsys):
    slot = tmp_path / "slot.bin"
    slot.write_bytes(b"\0" * 16)

    def broken(*args, **kwargs):
        raise KeyError("parts")  # what a scanner bug looks like from outside

    monkeypatch.setattr(kvscan, "scan_file", broken)
    assert cli.main(["scan", str(slot), "--json"]) == cli.EXIT_HARNESS_BUG == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert err.strip().splitlines()[-1].startswith("specharness: harness error: KeyError: 'parts'")


def test_bad_input_stays_a_one_line_error_with_exit_2(tmp_path, capsys):
    assert cli.main(["scan", str(tmp_path / "missing.bin")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("specharness: error:") and len(err.strip().splitlines()) == 1

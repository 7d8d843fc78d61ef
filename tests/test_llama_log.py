"""llama-server's log at `-lv 5` as the harness reads it: each line behind llama.cpp's `M.SS.mmm.uuu L ` prefix,
an abort line that can land behind another line's prefix, raw token bytes that are not UTF-8, debug lines after
the error that ended a start-up. Excerpts of real logs (llama.cpp 0c1e570, tiny models)."""

import subprocess
from pathlib import Path
from types import SimpleNamespace

from harness.backends.base import invalid_batch
from harness.backends.process import abort_line, crash_report, invalid_batch_in_log
from harness.backends.server import LlamaServer
from harness.backends.server_work import _read, count, task_lines
from harness.llama import log as llama_log
from harness.repro.script import HELPERS
from harness.signatures import of_error
from harness.verdict.signature import abort_reason

SRC = "/root/.cache/specharness/work/src/tools/server/server-context.cpp"
ASSERT = 'GGML_ASSERT(add_ok && "batch must be large enough to hold the sampled and draft tokens") failed'
CRASH_LOG = (
    b"0.00.629.041 D spec        draft:  - seq_id 0, draft candidate   0, pos   0:   6922 (   0.307) '\xc3\xb6g'\n"
    b"0.00.630.240 D spec        draft:  - seq_id 0, draft candidate   0, pos   1:  14127 (   0.166) ' am\xe9ric'\n"
    b"0.00.632.551 D spec        draft:  - seq_id 0, draft candidate   0, pos   3:  23036 (   0.268) 'Since'\n"
    b"0.00.632.579 D " + SRC.encode() + b":508: " + ASSERT.encode() + b"\n"
    b"spec        draft:  - seq_id 0, draft candidate   1, pos   3:   7285 (   0.130) 'reek'\n"
    b"0.00.632.580 D spec        draft:  - seq_id 0, draft candidate   2, pos   3:  22880 (   0.098) 'his'\n"
    b"0.00.632.620 D slot handle_last_: id  0 | task 1 | generate_draft: id=15150, #tokens=22, #draft=4, pos_next=22\n"
    b"[New LWP 30425]\n"
    b"0x00007f02392f1c17 in __GI___wait4 (pid=30457, stat_loc=0x0, options=0, usage=0x0) at wait4.c:30\n"
)
"""The end of a llama-server log whose par batch aborted: the logger's thread had written a debug line's prefix
when ggml printed the assert; one drafted token's bytes (`\\xe9`) are not UTF-8."""
STARTUP_LOG = (
    b"0.00.002.341 W srv  llama_server: security: no API key is set and CORS allows all origins\n"
    b"0.00.107.293 E llama_init_from_model: quantized V cache requires flash_attn to be enabled\n"
    b"0.00.107.310 E common_speculative_init_result: failed to create MTP context\n"
    b"0.00.107.324 E srv    load_model: failed to create MTP context\n"
    b"0.00.107.345 I srv    operator(): operator(): cleaning up before exit...\n"
    b"0.00.107.664 E srv  llama_server: exiting due to model loading error\n"
    b"0.00.111.051 D ~llama_context:        CPU compute buffer size is  41.5078 MiB, matches expectation of  41.5078 "
    b"MiB\n"
)
"""A start-up llama-server refused (a quantized V cache without flash attention): debug lines follow the error."""


def test_a_log_line_s_message_is_without_its_prefix_and_colours():
    assert (
        llama_log.message("0.00.632.579 D /src/a.cpp:5: GGML_ASSERT(x) failed") == "/src/a.cpp:5: GGML_ASSERT(x) failed"
    )
    assert llama_log.message("12.03.004.005 I srv  init: ok") == "srv  init: ok"
    coloured = "\x1b[0m\x1b[34m0.00.107.293\x1b[0m \x1b[31mE llama_init_from_model: refused\n"
    assert llama_log.message(coloured.strip()) == "llama_init_from_model: refused"
    assert llama_log.level(coloured) == "error" and llama_log.level("0.00.111.051 D x") == "debug"
    assert llama_log.message(" - the last position stored") == " - the last position stored"  # a continuation
    assert llama_log.level("spec draft: 'reek'") is None


def test_a_log_with_token_bytes_that_are_not_utf8_reads(tmp_path):
    log = tmp_path / "llama-server-par-1.log"
    log.write_bytes(CRASH_LOG)
    assert "am\ufffdric" in llama_log.read(log)
    assert llama_log.read(log, start=len(CRASH_LOG) - 10) == "ait4.c:30\n"


def test_the_abort_line_behind_another_line_s_prefix_gives_the_same_signature(tmp_path):
    log = tmp_path / "llama-server-par-1.log"
    log.write_bytes(CRASH_LOG)
    assert abort_line(llama_log.read(log)) == f"{SRC}:508: {ASSERT}"
    report = crash_report("llama-server", -6, log)
    assert report.startswith(f"llama-server was killed by SIGABRT: {SRC}:508: {ASSERT}; log ")
    clean = tmp_path / "llama-server-par-2.log"
    clean.write_bytes(CRASH_LOG.replace(b"0.00.632.579 D /root", b"/root"))
    assert of_error(report).text == of_error(crash_report("llama-server", -6, clean)).text == f"crash: {ASSERT}"
    # a report recorded with the prefix (before the harness took it off) has the same signature
    recorded = f"llama-server was killed by SIGABRT: 0.00.632.579 D {SRC}:508: {ASSERT}; log x ends with:\n..."
    assert abort_reason(recorded) == ASSERT and of_error(recorded).text == f"crash: {ASSERT}"


def test_a_refused_batch_is_found_behind_prefixes_and_a_thousand_debug_lines(tmp_path):
    log = tmp_path / "server.log"
    refusal = (
        b"0.01.208.000 E init: the tokens of sequence 3 in the input batch have inconsistent sequence positions:\n"
        b" - the last position stored in the memory module of the context (i.e. the KV cache) for sequence 3 is "
        b"X = 57\n"
        b" - the tokens for sequence 3 in the input batch have a starting position of Y = 56\n"
        b" it is required that the sequence positions remain consecutive: Y = X + 1\n"
        b"0.01.208.010 E decode: failed to initialize batch\n"
    )
    after = b"0.01.208.062 D spec        draft:  - seq_id 1, draft candidate   0, pos   0:   6922 (   0.307) '\xe9'\n"
    log.write_bytes(CRASH_LOG[:200] + refusal + after * 1000)
    assert invalid_batch_in_log(log) == invalid_batch(3, 57, 56)


def test_a_failed_start_up_names_llama_cpp_s_error_lines_not_the_last_debug_line(tmp_path):
    log = tmp_path / "llama-server-seq-1.log"
    log.write_bytes(b"$ llama-server -m tiny.gguf -lv 5\n" + STARTUP_LOG)
    server = LlamaServer(server_bin=Path("llama-server"), model=Path("tiny.gguf"), log_path=log)
    server.process = SimpleNamespace(returncode=1)
    message = server._startup_failure()
    assert message == (
        "llama-server exited with code 1 during start-up: llama_init_from_model: quantized V cache requires "
        f"flash_attn to be enabled … srv  llama_server: exiting due to model loading error (log: {log})"
    )
    log.write_bytes(b"$ llama-server\n0.00.000.902 I srv  llama_server: initializing\n0.00.111.051 D ~llama_context\n")
    assert server._startup_failure().endswith("during start-up: srv  llama_server: initializing (log: " + f"{log})")


def test_a_task_s_lines_are_read_behind_prefixes_and_past_bytes_that_are_not_utf8(tmp_path):
    log = tmp_path / "server.log"
    log.write_bytes(
        b"0.02.612.988 I slot launch_slot_: id  0 | task 1 | processing task, is_child = 0\n"
        b"0.02.613.000 D spec        draft:  - seq_id 0, draft candidate   0, pos   1:  14127 (   0.166) ' am\xe9ric'\n"
        b"0.02.981.602 D slot   operator(): id  0 | task 1 | add accepted tokens: sampled=1193, ids.size=2, n_draft=4\n"
        b"0.03.989.679 I slot      release: id  0 | task 1 | stop processing: n_tokens = 149, truncated = 0\n"
    )
    task, messages, ended = task_lines(_read(log, 0), 0)
    assert task == 1 and ended and count(messages).partial_rollbacks == 1


def _helpers(work: Path, script: str) -> str:
    """Run repro.sh's shell helpers (up to the verdicts) with `script` on logs in `work`."""
    body = HELPERS[HELPERS.index("unprefixed()") : HELPERS.index("reproduced()")]
    run = subprocess.run(["bash", "-c", f"WORK={work}\n{body}\n{script}"], capture_output=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return run.stdout.decode(errors="replace")


def test_repro_sh_reads_the_abort_and_the_start_up_error_behind_prefixes(tmp_path):
    (tmp_path / "subject.log").write_bytes(CRASH_LOG)
    (tmp_path / "start.log").write_bytes(STARTUP_LOG)
    numbered = ASSERT.replace("508", "N")
    out = _helpers(
        tmp_path,
        'echo "A: $(abort_line subject)"\n'
        f"same_abort subject 'server-context.cpp:N: {numbered}' && echo SAME\n"
        "same_abort subject 'GGML_ASSERT(other) failed' || echo OTHER\n"
        'echo "E: $(abort_line start)"\nstartup_said start\n',
    )
    lines = out.splitlines()
    assert lines[:4] == [
        f"A: {SRC}:508: {ASSERT}",
        "SAME",
        "OTHER",
        "E: srv  llama_server: exiting due to model loading error",
    ]
    assert lines[4] == "llama_init_from_model: quantized V cache requires flash_attn to be enabled"
    assert lines[-1] == "srv  llama_server: exiting due to model loading error"

"""A stall says whether llama-server spun or hung (harness.backends.slots_watch.log_since): the slot lines it
logged since the stalled slot's last token, word for word (timestamps left out), name a livelock; the task
queue's lines of every step do not; nothing logged is a hang. The spinning build of tests/test_stall_spin.py
shows it on a real server."""

from harness.backends.slots_watch import LIVELOCK_REPEATS, log_since

ERASE = "W slot create_check: id  1 | task 7 | erasing old context checkpoint (pos_min = 40, pos_max = 40)"
QUEUE = "D que  yield_to_que: yielding to queue"


def _log(tmp_path, lines):
    path = tmp_path / "llama-server.log"
    path.write_text("".join(f"0.00.{i:03d}.{i:03d} {line}\n" for i, line in enumerate(lines)))
    return path


def test_a_slot_line_repeated_word_for_word_since_the_last_token_names_a_livelock(tmp_path):
    before = ["I slot update_slots: id  1 | task 7 | new prompt, n_ctx_slot = 4096"]
    path = _log(tmp_path, before + [ERASE, QUEUE] * LIVELOCK_REPEATS)
    offset = len(path.read_text().splitlines()[0]) + 1
    said = log_since(path, offset)
    assert said.startswith("spinning:") and "erasing old context checkpoint" in said, said
    assert f"{LIVELOCK_REPEATS} times in {2 * LIVELOCK_REPEATS} lines" in said and "a livelock" in said


def test_lines_that_move_or_are_the_queue_s_name_no_livelock(tmp_path):
    moving = [f"D slot handle_last_: id  0 | task 3 | generate_draft: pos_next={20 + i}" for i in range(50)]
    said = log_since(_log(tmp_path, [x for line in moving for x in (line, QUEUE)]), 0)
    assert said == f"llama-server logged 100 lines since, no slot's line {LIVELOCK_REPEATS} times", said
    below = log_since(_log(tmp_path, [ERASE] * (LIVELOCK_REPEATS - 1)), 0)
    assert "livelock" not in below, below


def test_nothing_logged_since_the_last_token_is_a_hang(tmp_path):
    path = _log(tmp_path, [ERASE])
    assert log_since(path, path.stat().st_size) == "hung: llama-server logged nothing since"
    assert log_since(None, 0) == "" and log_since(tmp_path / "missing.log", 0) == ""

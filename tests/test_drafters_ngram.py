"""The n-gram drafters and the scripted test drafter, on small hand-checkable token lists."""

import pytest

from harness.engine.drafters.base import DraftRequest
from harness.engine.drafters.ngram_map import LCG_FACTOR, NgramMapK, NgramMapK4V, poly_hashes
from harness.engine.drafters.ngram_mod import MULT, TABLE_SIZE, NgramMod
from harness.engine.drafters.ngram_simple import NgramSimple
from harness.engine.drafters.scripted import Scripted


def req(history, id_last, n_max=64, seq_id=0):
    return DraftRequest(seq_id=seq_id, history=list(history), id_last=id_last, n_max=n_max)


# ngram-simple (size_n=2, size_m=3: pattern = last history token + id_last)


def test_simple_copies_what_followed_the_pattern():
    d = NgramSimple(size_n=2, size_m=3)
    assert d.draft(req([0, 1, 2, 3, 4, 5, 6, 7, 1], 2)) == [3, 4, 5]
    assert d.draft(req([0, 1, 2, 3, 4, 5, 6, 7, 1], 2, n_max=2)) == [3, 4]
    assert d.draft(req([0, 1, 2, 3, 4, 5, 6, 7, 1], 9)) == []


def test_simple_uses_the_latest_occurrence():
    d = NgramSimple(size_n=2, size_m=3)
    assert d.draft(req([0, 1, 2, 3, 4, 5, 1, 2, 7, 8, 9, 10, 1], 2)) == [7, 8, 9]


def test_simple_needs_history_longer_than_n_plus_m_plus_1():
    d = NgramSimple(size_n=2, size_m=3)
    assert d.draft(req([0, 1, 2, 3, 4, 1], 2)) == []  # 6 tokens = n + m + 1
    assert d.draft(req([0, 1, 2, 3, 4, 5, 1], 2)) == [3, 4, 5]


def test_simple_ignores_position_0_and_a_match_too_close_to_the_end():
    d = NgramSimple(size_n=2, size_m=3)
    assert d.draft(req([1, 2, 3, 4, 5, 6, 7, 1], 2)) == []  # only match at index 0
    # the latest match (index 8) has < size_n tokens after it: no draft, no fallback to index 1
    assert d.draft(req([9, 1, 2, 5, 5, 5, 5, 5, 1, 2, 1], 2)) == []


# ngram-map-k / -k4v (size_n=2, size_m=2: need 2n+m = 6 tokens)

PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 1]  # key [1, 2] (last token + id_last 2) occurs at index 1


def test_map_hash_is_the_32_bit_lcg_hash_mod_2_18():
    tokens = [5, 262144 + 7, 123456, 0, 99]
    ref = 0
    for t in tokens[1:4]:
        ref = (ref * LCG_FACTOR + t) % 2**32
    assert list(poly_hashes(tokens, 1, 3, 3, LCG_FACTOR, 18))[0] == ref % 2**18


def test_map_k_drafts_the_tokens_after_the_key():
    d = NgramMapK(size_n=2, size_m=2)
    d.begin(0, PROMPT)
    assert d.draft(req(PROMPT, 2, n_max=1)) == [3]
    assert d.draft(req(PROMPT, 9)) == []
    assert d.draft(req(PROMPT[:5], 2)) == []  # fewer than 2n+m tokens


@pytest.mark.parametrize(("n_accepted", "is_other", "expected"), [(0, False, []), (1, False, [3]), (0, True, [3, 4])])
def test_map_k_shortens_a_key_to_its_last_accepted_length(n_accepted, is_other, expected):
    d = NgramMapK(size_n=2, size_m=2)
    d.begin(0, PROMPT)
    assert d.draft(req(PROMPT, 2)) == [3, 4]
    d.accept(0, n_accepted, is_other)
    assert d.draft(req(PROMPT + [2, 9, 1], 2)) == expected
    assert d.draft(req(PROMPT + [2, 9, 1, 2, 8, 1], 2)) == expected  # unchanged until the next accept


def test_map_k_keeps_the_first_indexed_occurrence():
    d = NgramMapK(size_n=2, size_m=2)
    d.begin(0, PROMPT)
    assert d.draft(req(PROMPT, 2)) == [3, 4]
    d.accept(0, 2, False)
    # [1, 2] now also occurs later, followed by [8, 8]: the hash bucket keeps the prompt's occurrence
    history = PROMPT + [2, 3, 4, 1, 2, 8, 8, 5, 5, 5, 5, 5, 1]
    assert d.draft(req(history, 2)) == [3, 4]
    assert NgramSimple(size_n=2, size_m=2).draft(req(history, 2)) == [8, 8]
    d.accept(0, 2, False)
    assert d.draft(req(history + [2, 8, 8, 7, 7, 7, 7, 1], 2)) == [3, 4]  # index 12 was hashed: bucket taken


def test_map_k_hashes_the_prompt_from_its_end():
    d = NgramMapK(size_n=2, size_m=2)
    prompt = [0, 1, 2, 1, 2, 5, 6, 7, 8, 9, 1]  # [1, 2] at indices 1 and 3: the bucket gets 3
    d.begin(0, prompt)
    assert d.draft(req(prompt, 2)) == [5, 6]
    d.accept(0, 2, False)
    assert d.draft(req(prompt + [2, 9, 1], 2)) == [5, 6]


def test_map_k_begin_forgets_keys_of_a_removed_history_part():
    history = [0, 1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1]
    for prompt, expected in ((PROMPT[:4], [3, 4]), (PROMPT, [])):
        d = NgramMapK(size_n=2, size_m=2)
        d.begin(0, PROMPT)
        assert d.draft(req(PROMPT, 2)) == [3, 4]
        d.accept(0, 0, False)  # the key [1, 2] stops drafting
        d.begin(0, prompt)  # a shorter prompt than the last history: its keys are dropped
        assert d.draft(req(history, 2)) == expected


def test_map_k4v_needs_a_dominant_continuation():
    d = NgramMapK4V(size_n=2, size_m=2)
    ambiguous = [0, 1, 2, 3, 4, 1, 2, 5, 6, 9, 9, 1]  # [1, 2] → [3, 4] once, [5, 6] once
    d.begin(0, ambiguous)
    assert d.draft(req(ambiguous, 2)) == []
    assert NgramMapK(size_n=2, size_m=2).draft(req(ambiguous, 2)) == [5, 6]
    d = NgramMapK4V(size_n=2, size_m=2)
    dominant = [0, 1, 2, 5, 6, 1, 2, 3, 4, 1, 2, 3, 4, 9, 9, 1]  # [3, 4] twice, [5, 6] once
    d.begin(0, dominant)
    assert d.draft(req(dominant, 2)) == [3, 4]


def test_map_k4v_copies_from_the_found_occurrence_not_the_dominant_value():
    d = NgramMapK4V(size_n=2, size_m=2)
    history = [0, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 9, 9, 1]  # latest occurrence is followed by [5, 6]
    d.begin(0, history)
    assert d.draft(req(history, 2)) == [5, 6]


def test_map_k4v_counts_the_found_occurrence_again_on_each_hit():
    d = NgramMapK4V(size_n=2, size_m=2)
    history = [0, 1, 2, 5, 6, 1, 2, 3, 4, 9, 9, 1]  # [1, 2] → [5, 6] once, [3, 4] once (found at index 5)
    d.begin(0, history)
    assert d.draft(req(history, 2)) == []
    # hit again at index 5: llama.cpp recounts from there, [3, 4] now counts 2 against 1
    assert d.draft(req(history + [2, 9, 1], 2)) == [3, 4]


def test_map_k4v_min_hits():
    d = NgramMapK4V(size_n=2, size_m=2, min_hits=2)
    d.begin(0, PROMPT)
    assert d.draft(req(PROMPT, 2)) == []  # first hit of the key
    assert d.draft(req(PROMPT + [2, 9, 1], 2)) == [3, 4]


def test_map_state_is_per_sequence():
    d = NgramMapK(size_n=2, size_m=2)
    for seq in (0, 1):
        d.begin(seq, PROMPT)
        assert d.draft(req(PROMPT, 2, seq_id=seq)) == [3, 4]
    d.accept(0, 0, False)
    assert d.draft(req(PROMPT + [2, 9, 1], 2, seq_id=0)) == []
    assert d.draft(req(PROMPT + [2, 9, 1], 2, seq_id=1)) == [3, 4]


# ngram-mod


def test_mod_hash_is_the_64_bit_polynomial_hash_mod_table_size():
    tokens = [3, 150000, -1, 7, 2**31 - 1]
    refs = []
    for start in (0, 1):
        ref = 0
        for t in tokens[start : start + 4]:
            ref = (ref * MULT + t) % 2**64
        refs.append(ref % TABLE_SIZE)
    assert list(poly_hashes(tokens, 0, 2, 4, MULT, 22)) == refs


def test_mod_chains_lookups_with_a_rolling_hash():
    prompt = [150000 + i for i in range(40)]  # every 5-gram distinct
    d = NgramMod(n_match=5, n_min=1, n_max=64)
    d.begin(0, prompt)
    assert d.draft(req([7] + prompt[:4], prompt[4])) == prompt[5:]  # until the last n-gram, which has no next
    assert d.draft(req([7] + prompt[:4], prompt[4], n_max=3)) == prompt[5:8]


def test_mod_table_is_shared_and_last_writer_wins():
    d = NgramMod(n_match=2, n_min=1, n_max=4)
    d.begin(0, [1, 2, 3, 4, 5])
    assert d.draft(req([7, 1], 2, seq_id=1)) == [3, 4, 5]  # seq 1 sees seq 0's prompt
    d.begin(1, [1, 2, 6])
    assert d.draft(req([7, 1], 2, seq_id=0)) == [6]


@pytest.mark.parametrize(("n_min", "expected"), [(3, [3, 4, 5]), (4, [])])
def test_mod_miss_before_n_min_means_no_draft(n_min, expected):
    d = NgramMod(n_match=2, n_min=n_min, n_max=8)
    d.begin(0, [1, 2, 3, 4, 5])
    assert d.draft(req([7, 1], 2)) == expected


def test_mod_short_history_and_pending_chunk():
    d = NgramMod(n_match=3, n_min=1, n_max=4)
    d.begin(0, [1, 2])  # shorter than n_match: nothing inserted
    assert d.draft(req([1], 2)) == []
    base = list(range(100, 120)) + [9, 1, 2, 3, 4] + list(range(200, 204))  # n-grams pending from index 0
    assert d.draft(req(base + [5, 9, 1], 2)) == []  # 32 tokens: not more than 32 pending yet
    assert d.draft(req(base + [5, 6, 9, 1], 2)) == [3, 4, 200, 201]  # 33 tokens: inserted first


def test_mod_resets_after_5_low_acceptance_drafts():
    d = NgramMod(n_match=2, n_min=1, n_max=4)
    d.begin(0, [1, 2, 3, 4, 5])
    for i in range(8):
        assert d.draft(req([7, 1], 2)) == [3, 4, 5]
        d.accept(0, 0, True)  # another drafter's draft: ignored
        d.accept(0, 0 if i != 3 else 1, False)  # 0/3 is low; 1/3 is not and restarts the streak
    assert d.draft(req([7, 1], 2)) == [3, 4, 5]
    d.accept(0, 0, False)  # 5th low draft in a row
    assert d.draft(req([7, 1], 2)) == []
    assert d.used == 0


def test_mod_begin_resets_a_table_over_a_quarter_full():
    d = NgramMod(n_match=2, n_min=1, n_max=4)
    d.begin(0, [1, 2, 3])
    d.used = TABLE_SIZE // 4  # pretend the table is exactly a quarter full
    d.begin(1, [1, 2])  # adds nothing: 25 % is not over the limit
    assert d.draft(req([7, 1], 2)) == [3]
    d.begin(1, [4, 5, 6])  # one more entry: over the limit
    assert d.draft(req([7, 1], 2)) == []


# scripted

CONT = [10, 11, 12, 13, 14, 15, 16, 17, 18]
PROMPT_S = [1, 2, 3]


def run_scripted(drafter, seq_id=0):
    """Greedy match-verification against CONT; the accepted count of every step."""
    drafter.begin(seq_id, PROMPT_S)
    history, k, accepted = list(PROMPT_S), 0, []
    while k + 1 < len(CONT):
        draft = drafter.draft(req(history, CONT[k], n_max=8, seq_id=seq_id))
        n = next((i for i, t in enumerate(draft) if t != CONT[k + 1 + i]), len(draft))
        accepted.append(n)
        history += CONT[k : k + 1 + n]
        k += 1 + n
    return accepted


def test_scripted_proposes_the_continuation():
    d = Scripted(CONT, n_max=4)
    d.begin(0, PROMPT_S)
    assert d.draft(req(PROMPT_S, 10)) == [11, 12, 13, 14]
    assert d.draft(req(PROMPT_S, 10, n_max=2)) == [11, 12]
    assert d.draft(req(PROMPT_S + CONT[:6], 16)) == [17, 18]  # end of the script
    assert run_scripted(d) == [4, 3]


def test_scripted_wrong_tokens():
    d = Scripted(CONT, n_max=4, wrong_at={2})  # output offset 2 is token 12
    d.begin(0, PROMPT_S)
    assert d.draft(req(PROMPT_S, 10)) == [11, 11, 13, 14]
    assert (d.wrong(12), d.wrong(1), d.wrong(0)) == (11, 0, 1)  # always a valid id, whatever the vocabulary
    assert run_scripted(Scripted(CONT, n_max=4, wrong_at=lambda s, j, k: k == 2)) == [2, 2, 2]
    assert run_scripted(Scripted(CONT, n_max=4, reject_all=True)) == [0] * 8


def test_scripted_per_sequence_scripts():
    d = Scripted({0: CONT, 1: [20, 21, 22]}, n_max=2)
    d.begin(0, PROMPT_S)
    d.begin(1, [5])
    assert d.draft(req(PROMPT_S, 10, seq_id=0)) == [11, 12]
    assert d.draft(req([5], 20, seq_id=1)) == [21, 22]
    assert d.draft(req([5, 20], 21, seq_id=1)) == [22]
    none = Scripted(None)
    none.begin(0, PROMPT_S)
    assert none.draft(req(PROMPT_S, 10)) == []

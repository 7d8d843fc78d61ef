"""ngram-cache: the port against hand-checked cases and, draft for draft, against llama.cpp's own
`common/ngram-cache.cpp` (compiled from the vendored tree) driven as `common_speculative_impl_ngram_cache` drives it."""

import random
import shutil
import subprocess

import pytest

from harness.engine.drafters.base import DraftRequest
from harness.engine.drafters.ngram_cache import NgramCache, cache_draft, cache_update


def req(history, id_last, n_max=64, seq_id=0):
    return DraftRequest(seq_id=seq_id, history=list(history), id_last=id_last, n_max=n_max)


def test_update_counts_only_ngrams_inside_the_list():
    cache = {}
    cache_update(cache, [1, 2, 1, 3])
    assert cache[(1, -1, -1, -1)] == {2: 1, 3: 1}
    assert cache[(1, 2, -1, -1)] == {1: 1}
    assert cache[(1, 2, 1, -1)] == {3: 1}
    assert (2, 1, 3, -1) not in cache  # nothing follows it
    cache_update(cache, [4, 5])  # a later update: no n-gram straddles [.., 3] + [4, ..]
    assert (3, -1, -1, -1) not in cache and cache[(4, -1, -1, -1)] == {5: 1}


def test_draft_prefers_the_longest_ngram_that_passes_its_thresholds():
    cache = {}
    cache_update(cache, [7, 1, 2, 9, 7, 1, 2, 9, 5, 1, 2, 8])
    # [1, 2] → {9: 2, 8: 1} (67 %); then the 3-gram [1, 2, 9] → {7: 1, 5: 1}, a tie at 50 % that passes (the
    # later-inserted 5 wins), then 3-grams [2, 9, 5] → 1, [9, 5, 1] → 2, [5, 1, 2] → 8, then nothing
    assert cache_draft([0, 0, 1], 2, cache, 8) == [9, 5, 1, 2, 8]
    assert cache_draft([0, 0, 1], 2, cache, 2) == [9, 5]
    assert cache_draft([3], 2, cache, 1) == [9]  # 1-gram [2]: 2 of 3 samples, 67 % ≥ 66 %
    cache_update(cache, [2, 8])
    assert cache_draft([3], 2, cache, 1) == []  # now 2 of 4: below 66 %
    assert cache_draft([0, 1], 2, cache, 1) == [9]  # the 2-gram [1, 2] still 2 of 3 ≥ 50 %


def test_a_two_way_tie_goes_to_the_later_inserted_token():
    cache = {}
    cache_update(cache, [3, 4, 6, 3, 4, 5])  # [3, 4] → {6: 1, 5: 1}: 50 % passes for a 2-gram
    assert cache[(3, 4, -1, -1)] == {6: 1, 5: 1}
    assert cache_draft([3], 4, cache, 1) == [5]


def test_begin_empties_the_cache_unless_kept_across_requests():
    first, second = [1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 7, 6, 5, 4]
    for keep, expected in ((False, []), (True, [3, 1])):
        d = NgramCache(keep_across_requests=keep)
        d.begin(0, first)
        assert d.draft(req(first, 3, n_max=2)) == [1, 2]
        d.begin(0, second)
        # kept: the old counts stay and the new prompt (shorter than the old history) is never counted
        assert d.draft(req(second, 2, n_max=2)) == expected


# --- draft for draft against the C++ ------------------------------------------------------------------------------

STUB_LLAMA_H = """
#pragma once
#include <cstdint>
#include <cstdlib>
typedef int32_t llama_token;
#define LLAMA_TOKEN_NULL -1
#define GGML_ASSERT(x) do { if (!(x)) abort(); } while (0)
static inline int64_t ggml_time_ms(void) { return 0; }
"""
STUB_LOG_H = "#pragma once\n#define LOG_DBG(...) ((void) 0)\n"

DRIVER = r"""
// common_speculative_impl_ngram_cache::draft_one of common/speculative.cpp at 0c1e570, begin() a no-op,
// on an n_draft of 8; each input line: seq_id id_last n_max n_history history... ; output: the draft.
#include "ngram-cache.h"
#include <cstdio>
#include <map>
#include <vector>
typedef std::vector<llama_token> llama_tokens;
struct seq_info {
    size_t cache_size = 0;
    common_ngram_cache ngram_cache_context, ngram_cache_dynamic, ngram_cache_static;
};
int main() {
    std::map<int, seq_info> sinfos;
    int seq_id, id_last, n_max, n;
    while (scanf("%d %d %d %d", &seq_id, &id_last, &n_max, &n) == 4) {
        llama_tokens prompt(n);
        for (int i = 0; i < n; ++i) scanf("%d", &prompt[i]);
        auto & sinfo = sinfos[seq_id];
        llama_tokens result;
        if (sinfo.cache_size < prompt.size() + 1) {
            llama_tokens tokens_new;
            for (size_t j = sinfo.cache_size; j < prompt.size(); ++j) tokens_new.push_back(prompt[j]);
            tokens_new.push_back(id_last);
            common_ngram_cache_update(sinfo.ngram_cache_context, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, tokens_new,
                                      tokens_new.size(), false);
            sinfo.cache_size = prompt.size() + 1;
        }
        llama_tokens inp(prompt);
        inp.push_back(id_last);
        result.push_back(id_last);
        common_ngram_cache_draft(inp, result, 8, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX, sinfo.ngram_cache_context,
                                 sinfo.ngram_cache_dynamic, sinfo.ngram_cache_static);
        result.erase(result.begin());
        if ((int) result.size() > n_max) result.resize(n_max);
        for (size_t i = 0; i < result.size(); ++i) printf("%s%d", i ? " " : "", result[i]);
        printf("\n");
    }
    return 0;
}
"""


@pytest.fixture(scope="module")
def cxx(tmp_path_factory):
    """The C++ driver compiled against the vendored common/ngram-cache.cpp."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    from harness.backends.build import vendored_source
    from harness.errors import HarnessError

    try:
        common = vendored_source() / "common"
    except HarnessError as err:
        pytest.skip(f"no vendored llama.cpp tree: {err}")
    work = tmp_path_factory.mktemp("ngram-cache-cxx")
    (work / "llama.h").write_text(STUB_LLAMA_H)
    (work / "log.h").write_text(STUB_LOG_H)
    (work / "common.h").write_text("#pragma once\n")
    (work / "driver.cpp").write_text(DRIVER)
    for name in ("ngram-cache.h", "ngram-cache.cpp"):
        shutil.copy(common / name, work / name)
    exe = work / "driver"
    cmd = [compiler, "-std=c++17", "-O1", "-I", str(work), str(work / "driver.cpp"), str(work / "ngram-cache.cpp")]
    subprocess.run([*cmd, "-o", str(exe)], check=True, capture_output=True)
    return exe


def scenario(rng: random.Random, vocab: int, n_seqs: int):
    """Requests on a few sequences, each a prompt and then steps (a drafted step sees the history grow by id_last
    and what was accepted): tokens from a noisy bigram table, so n-grams repeat with several continuations (ties,
    thresholds just met or missed); three requests per sequence, later prompts often shorter than the history
    the sequence had (the cache is kept across requests)."""
    table = [rng.randrange(vocab) for _ in range(vocab)]

    def stream(prev: int, n: int) -> list[int]:
        out = []
        for _ in range(n):
            prev = table[prev] if rng.random() < 0.75 else rng.randrange(vocab)
            out.append(prev)
        return out

    calls = []
    for _ in range(3):
        for seq in range(n_seqs):
            history = stream(0, rng.randrange(3, 40))
            calls.append(("begin", seq, list(history)))
            for _ in range(rng.randrange(5, 30)):
                id_last, *more = stream(history[-1], 1 + rng.randrange(0, 4))
                calls.append(("draft", seq, list(history), id_last, rng.choice((8, 8, 3, 1))))
                history += [id_last, *more]
    return calls


@pytest.mark.parametrize("seed", range(6))
def test_port_drafts_as_the_cxx_does(cxx, seed):
    rng = random.Random(seed)
    calls = scenario(rng, vocab=(5, 9, 16)[seed % 3], n_seqs=2)
    lines = [f"{c[1]} {c[3]} {c[4]} {len(c[2])} {' '.join(map(str, c[2]))}" for c in calls if c[0] == "draft"]
    out = subprocess.run([str(cxx)], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    expected = [[int(t) for t in line.split()] for line in out.stdout.splitlines()]
    drafter = NgramCache(keep_across_requests=True)  # the C++'s begin() is a no-op
    got = []
    for call in calls:
        if call[0] == "begin":
            drafter.begin(call[1], call[2])
        else:
            got.append(drafter.draft(req(call[2], call[3], n_max=call[4], seq_id=call[1])))
    assert sum(map(len, expected)) > 100  # the scenario drafts
    assert got == expected

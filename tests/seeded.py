"""A llama-server with a seeded rollback bug, built through the build cache like any other source tree.

The bug class of llama.cpp PR #20925: after rejected drafts the attention cells past the accepted tokens
stay in the KV cache. In tools/server/server-context.cpp the seeded variant drops the `seq_rm` that
follows a checkpoint restore (the rollback of hybrid and recurrent targets) and the `seq_rm` that follows a
partial acceptance (the rollback of attention-only targets such as Gemma 3, which never take the
checkpoint path).

`seeded_tree` seeds other variants too, in server-context.cpp or (`file`) in any other file of the tree: the
sampled-verification bug below is in common/sampling.cpp."""

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from filelock import FileLock

from harness.backends.build import SOURCE_MARKER, BuildInfo, ensure_server, read_marker, vendored_source
from harness.paths import cache_dir

SEEDED = {
    "                        slot.mem.seq_rm(slot.id, ckpt.pos_max + 1, -1);\n": "                        // seeded bug: no seq_rm after the checkpoint restore\n",
    "            slot.mem.seq_rm(slot.id, slot.prompt.tokens.pos_next(), -1);\n": "            // seeded bug: no seq_rm of the rejected drafts\n",
}


ROOT = Path(__file__).resolve().parents[1]


def server_suite_run(server_bin: Path, suite: str, out: Path, *extra: str, timeout: float = 900) -> tuple:
    """`specharness run --suite SUITE --backend server --server-bin BIN --out OUT EXTRA...` from the checkout:
    (the finished process, its checks.json records; [] where it wrote none)."""
    argv = ["run", "--suite", suite, "--backend", "server", "--server-bin", str(server_bin), *extra, "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "harness.cli", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    checks = json.loads((out / "checks.json").read_text()) if (out / "checks.json").is_file() else []
    return proc, checks


SERVER_CONTEXT = "tools/server/server-context.cpp"
"""The file a seeded variant edits unless it names another (the server's slot and speculative loop)."""


def seeded_tree(
    edits: dict[str, str] = SEEDED,
    name: str = "seeded-no-seq-rm",
    origin: str = "tests/seeded.py",
    file: str = SERVER_CONTEXT,
    source: Path | None = None,
) -> Path:
    """The vendored tree (or `source`, any extracted tree with a marker, e.g. a tag's `llama.cpp-b11434`) with
    `edits` (text -> replacement, each text found exactly once) applied to `file` (a path relative to the tree's
    root, tools/server/server-context.cpp unless given), kept in the cache as `<source's name>-<name>` (so variants
    of different sources never collide; same bytes, same build key, built once). The marker records a digest of
    (file, edits): a tree staged with other edits under the same name is staged again, not built as it is (trees
    staged before the digest was recorded are kept)."""
    source = Path(source) if source is not None else vendored_source()
    tree = cache_dir() / "src" / f"{source.name}-{name}"
    target = tree / file
    digest = hashlib.sha256(json.dumps([file, sorted(edits.items())]).encode()).hexdigest()[:16]
    with FileLock(str(tree) + ".lock"):
        if target.is_file() and json.loads((tree / SOURCE_MARKER).read_text()).get("edits", digest) != digest:
            shutil.rmtree(tree)
        if not target.is_file():
            staging = tree.with_name(tree.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(source, staging, symlinks=True)
            path = staging / file
            text = path.read_text()
            for line, replacement in edits.items():
                assert text.count(line) == 1, f"{source.name}'s {file} changed: cannot seed {line.strip()!r}"
                text = text.replace(line, replacement)
            path.write_text(text)
            commit = read_marker(source / SOURCE_MARKER)
            (staging / SOURCE_MARKER).write_text(
                json.dumps({"commit": f"{commit[:12]}-{name}", "origin": origin, "edits": digest}) + "\n"
            )
            staging.rename(tree)
    return tree


def seeded_server() -> BuildInfo:
    return ensure_server(source=seeded_tree())


SAMPLED_VERIFY = {
    (
        "    for (; i < draft.size(); i++) {\n"
        "        const llama_token id = common_sampler_sample(gsmpl, ctx, idxs[i], grammar_first);\n"
    ): (
        "    for (; i < draft.size(); i++) {\n"
        "        llama_token id = common_sampler_sample(gsmpl, ctx, idxs[i], grammar_first);\n"
        "        // seeded bug: a draft that is the target's most probable token is accepted, whatever the sampler drew\n"
        "        if (draft[i] == common_sampler_get_candidates(gsmpl, true)->data[0].id) { id = draft[i]; }\n"
    ),
}
"""A sampled-verification bug in common/sampling.cpp (`common_sampler_sample_and_accept_n`, the sample-and-match
verification of every drafter at 0c1e570): a drafted token is accepted when it is the target's most probable token
under the request's chain (the first of the sorted candidates), not only when it equals the token the sampler
drew; the accepted draft is what the request returns and what the KV cache holds. At temperature 0 the chain keeps
only the argmax, which is also the token drawn, so greedy output is untouched; at temperature > 0 the output leans
to the argmax (the sampler still draws, so its random state moves as without the bug) and seeded sampled output
departs from the non-speculative output. The for line anchors the edit: the same sample line follows the loop."""
SAMPLED_VERIFY_NAME = "seeded-sampled-verify"

EXTRA_DRAW = {
    (
        "        if (draft[i] != id || (llama_vocab_is_eog(vocab, id) && i + 1 < draft.size())) {\n            break;\n"
    ): (
        "        if (draft[i] != id || (llama_vocab_is_eog(vocab, id) && i + 1 < draft.size())) {\n"
        "            // seeded bug: one more draw of the chain's generator after a rejected draft\n"
        "            if (draft[i] != id) { common_sampler_sample(gsmpl, ctx, idxs[i], grammar_first); }\n"
        "            break;\n"
    ),
}
"""The extra-draw class in common/sampling.cpp (`common_sampler_sample_and_accept_n`): after a rejected draft the
chain samples the row once more, a draw that nothing uses. The distribution of the output is kept; the seeded tokens
after the first rejection move (where no checkpoint restore puts the sampler back: a dense target)."""
EXTRA_DRAW_NAME = "seeded-extra-draw"


def extra_draw_server() -> BuildInfo:
    """The vendored llama-server with EXTRA_DRAW (built once through the build cache)."""
    return ensure_server(source=seeded_tree(EXTRA_DRAW, EXTRA_DRAW_NAME, "tests/seeded.py", file="common/sampling.cpp"))


def sampled_verify_server() -> BuildInfo:
    """The vendored llama-server with SAMPLED_VERIFY (built once through the build cache; the compiler cache serves
    every object but common/sampling.cpp's)."""
    return ensure_server(
        source=seeded_tree(SAMPLED_VERIFY, SAMPLED_VERIFY_NAME, "tests/seeded.py", file="common/sampling.cpp")
    )


GRAMMAR_NOT_ADVANCED = {
    (
        "        common_sampler_accept(gsmpl, id, true);\n\n        result.push_back(id);\n\n"
        "        // do not accept draft tokens after an EOG"
    ): (
        "        common_sampler_accept(gsmpl, id, false);  // seeded bug: the grammar is not advanced for drafts\n\n"
        "        result.push_back(id);\n\n"
        "        // do not accept draft tokens after an EOG"
    ),
}
"""The grammar-state class in common/sampling.cpp (`common_sampler_sample_and_accept_n`): a verified draft token is
accepted by the sampler chain (penalties, the RNG) but not by the grammar, so the grammar stays behind the tokens
and later constrains the wrong positions. Greedy output without a grammar is untouched."""
TWO_DEFECTS_NAME = "seeded-two-defects"


def two_defect_server() -> BuildInfo:
    """The vendored llama-server with two seeded defects (issue 63): SEEDED (rejected drafts left in the KV cache)
    and GRAMMAR_NOT_ADVANCED, built once through the build cache on top of SEEDED's tree."""
    return ensure_server(
        source=seeded_tree(
            GRAMMAR_NOT_ADVANCED, TWO_DEFECTS_NAME, "tests/seeded.py", file="common/sampling.cpp", source=seeded_tree()
        )
    )


INTERMITTENT = {
    "                            ckpt.load_dft(slot.ctx_dft, slot.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);\n": (
        "                            if (ggml_time_us() % 16 != 0) {  // seeded bug: a race, 1 restore in 16 skips it\n"
        "                                ckpt.load_dft(slot.ctx_dft, slot.id, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY);\n"
        "                            }\n"
    ),
}
"""An intermittent defect (issue 63, item 5): a speculative checkpoint restore leaves the draft context unrestored
when the clock's microseconds are a multiple of 16, as a race would, about 1 restore in 16. The next `seq_rm` of a
recurrent or hybrid draft context cannot drop the suffix it still holds, and llama-server aborts ("failed to remove
sequence N", common/common.cpp:1539); whether a request meets it depends on the time, not on the request."""
INTERMITTENT_NAME = "seeded-intermittent-draft-restore"


def intermittent_server() -> BuildInfo:
    """The vendored llama-server with INTERMITTENT (built once through the build cache)."""
    return ensure_server(source=seeded_tree(INTERMITTENT, INTERMITTENT_NAME))

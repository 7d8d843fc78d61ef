"""A llama-server with a seeded rollback bug, built through the build cache like any other source tree.

The bug class of llama.cpp PR #20925: after rejected drafts the attention cells past the accepted tokens
stay in the KV cache. In tools/server/server-context.cpp the seeded variant drops the `seq_rm` that
follows a checkpoint restore (the rollback of hybrid and recurrent targets) and the `seq_rm` that follows a
partial acceptance (the rollback of attention-only targets such as Gemma 3, which never take the
checkpoint path)."""

import json
import shutil
from pathlib import Path

from filelock import FileLock

from harness.backends.build import SOURCE_MARKER, BuildInfo, ensure_server, read_marker, vendored_source
from harness.paths import cache_dir

SEEDED = {
    "                        slot.mem.seq_rm(slot.id, ckpt.pos_max + 1, -1);\n": "                        // seeded bug: no seq_rm after the checkpoint restore\n",
    "            slot.mem.seq_rm(slot.id, slot.prompt.tokens.pos_next(), -1);\n": "            // seeded bug: no seq_rm of the rejected drafts\n",
}


def seeded_tree(
    edits: dict[str, str] = SEEDED, name: str = "seeded-no-seq-rm", origin: str = "tests/seeded.py"
) -> Path:
    """The vendored tree with `edits` (line -> replacement) applied to tools/server/server-context.cpp, kept in the
    cache under `name` (same bytes, same build key, built once)."""
    source = vendored_source()
    tree = cache_dir() / "src" / f"{source.name}-{name}"
    target = tree / "tools" / "server" / "server-context.cpp"
    with FileLock(str(tree) + ".lock"):
        if not target.is_file():
            staging = tree.with_name(tree.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            shutil.copytree(source, staging, symlinks=True)
            path = staging / "tools" / "server" / "server-context.cpp"
            text = path.read_text()
            for line, replacement in edits.items():
                assert text.count(line) == 1, f"the vendored server-context.cpp changed: cannot seed {line.strip()!r}"
                text = text.replace(line, replacement)
            path.write_text(text)
            commit = read_marker(source / SOURCE_MARKER)
            (staging / SOURCE_MARKER).write_text(
                json.dumps({"commit": f"{commit[:12]}-{name}", "origin": origin}) + "\n"
            )
            staging.rename(tree)
    return tree


def seeded_server() -> BuildInfo:
    return ensure_server(source=seeded_tree())

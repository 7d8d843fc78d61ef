"""Building llama-server (and llama-quantize) from a llama.cpp source tree, cached by source identity.

- `sources`: what is built (the tree vendored in llama-cpp-python, a release, a checkout) and its identity;
- `tags`: an upstream release tag's sources and CMake options; `versions`: which llama.cpp version a build is;
- `cmake`: the CMake / Ninja step, in a persistent build tree per (source, backend, options);
- `wheel_link`: linking llama-cpp-python's own libllama, ggml and mtmd instead of compiling them;
- `entry`: one cache entry (`BuildInfo`, its lock and atomic replacement); `cache`: listing and pruning entries;
- `ensure`: a build by key, built once (`ensure_server`); `cli`: `specharness build`.
"""

from harness.backends.build.cmake import BACKENDS, build_tree_dir, cmake_options, work_dir
from harness.backends.build.ensure import cached_server, ensure_server, prebuilt_server
from harness.backends.build.entry import BuildInfo, load_build, require_executable
from harness.backends.build.sources import SOURCE_MARKER, read_marker, source_identity, vendored_source

__all__ = [
    "BACKENDS",
    "SOURCE_MARKER",
    "BuildInfo",
    "build_tree_dir",
    "cached_server",
    "cmake_options",
    "ensure_server",
    "load_build",
    "prebuilt_server",
    "read_marker",
    "require_executable",
    "source_identity",
    "vendored_source",
    "work_dir",
]

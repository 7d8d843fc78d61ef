"""What a started backend's llama.cpp is and how it was built, for `run.json`, a repro's ISSUE.md and the
benchmark pages. The commands ask the live backends here and hand the facts to the report writer, which reads
and writes stored runs only (it runs no llama.cpp tool)."""

from harness.backends.build.versions import build_version, engine_version
from harness.backends.flags import server_version
from harness.errors import HarnessError


def backend_facts(name: str, backend) -> dict:
    """A started backend's environment plus how its llama.cpp was built: llama-server's build (commit,
    CMake options, compiler; no paths) and its `--version`, or llama-cpp-python's system info."""
    facts = dict(backend.environment())
    build = getattr(backend, "build", None)
    if build is not None:
        data = build.to_json()
        facts["build"] = {
            k: data[k]
            for k in ("commit", "dirty", "backend", "cmake_args", "linked_libraries", "compiler", "built_at")
            if data.get(k, "") != ""
        }
        facts["version"] = server_version(build.server_bin)
        facts["llama_cpp_version"] = str(build_version(build))
    elif name == "inproc":
        import llama_cpp

        facts["llama_cpp_version"] = str(engine_version())
        facts["system_info"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return facts


def run_backends(executor) -> dict:
    """backend name → `backend_facts` of every backend the executor started (`{"error": ...}` for one that
    cannot say): the `backends` of run.json."""
    out = {}
    for name, backend in executor.backends().items():
        try:
            out[name] = backend_facts(name, backend)
        except HarnessError as err:
            out[name] = {"error": str(err)}
    return out

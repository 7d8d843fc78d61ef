"""Which flags a llama-server build takes, from its `--help`: the option column only (not words of the
descriptions), each flag's arity (a switch, one value, two), a clear error when `--help` fails, and a command
line fitted to a build whose flag changed arity (`-fa` was a switch before `-fa on|off|auto`)."""

import stat
from pathlib import Path

import pytest

from harness.backends.flags import fit_to_build, parse_help, server_flags
from harness.errors import HarnessError, Unservable

RECORDED = Path(__file__).parent / "data" / "llama-server-help.txt"
"""The real `llama-server --help` of the vendored llama.cpp (recorded; see test_the_recorded_help_is_this_builds)."""


def option(args: list[str], hint: str | None, text: str) -> str:
    """One option as llama.cpp common/arg.cpp `common_arg::to_string` prints it."""
    if len(args) == 1:
        head = args[0]
    else:
        first = args[0] + ", "
        head = first + " " * max(0, 7 - len(first)) + ", ".join(args[1:])
    if hint:
        head += " " + hint
    head = head + "\n" + " " * 40 if len(head) > 37 else head + " " * (40 - len(head))
    return head + text + "\n"


NEW_HELP = (
    "----- common params -----\n\n"
    + option(["-h", "--help", "--usage"], None, "print usage and exit")
    + option(["-m", "--model"], "FNAME", "model path to load")
    + option(["-fa", "--flash-attn"], "[on|off|auto]", "set Flash Attention use ('on', 'off', or 'auto')")
    + option(["--control-vector-layer-range"], "START END", "layer range to apply the control vector(s) to")
    + option(["-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"], None, "use a single unified KV buffer")
    + option(["--pooling"], "{none,mean,cls,last,rank}", "pooling type for embeddings")
    + "\n\n----- speculative params -----\n\n"
    + option(["--spec-draft-n-max", "--draft-max"], "N", "number of tokens to draft (default: 16)")
    + option(
        ["--draft-min"],
        "N",
        "removed: use --spec-draft-n-min\n" + " " * 40 + "-1 = unlimited, -ub and -b accept any size, see -Zz",
    )
)
OLD_HELP = NEW_HELP.replace(
    option(["-fa", "--flash-attn"], "[on|off|auto]", "set Flash Attention use ('on', 'off', or 'auto')"),
    option(["-fa", "--flash-attn"], None, "enable Flash Attention (default: disabled)"),
)


def fake_server(tmp_path: Path, help_text: str, status: int = 0) -> Path:
    """An executable that prints `help_text` for `--help` and exits with `status`."""
    (tmp_path / "help.txt").write_text(help_text)
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\ncat '{tmp_path / 'help.txt'}'\nexit {status}\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def test_flags_come_from_the_option_column_with_their_arity(tmp_path):
    flags = server_flags(fake_server(tmp_path, NEW_HELP))
    assert {"-m", "--model", "-fa", "--flash-attn", "-kvu", "--no-kv-unified", "--draft-max"} <= flags
    # words of the descriptions are not flags
    assert not {"--spec-draft-n-min", "-ub", "-b", "-1", "-Zz", "-----"} & flags
    assert flags.arity["-fa"] == 1 and flags.arity["-m"] == 1 and flags.arity["--pooling"] == 1
    assert flags.arity["--no-kv-unified"] == 0 and flags.arity["--help"] == 0
    assert flags.arity["--control-vector-layer-range"] == 2


def test_a_help_that_exits_non_zero_is_a_one_line_error(tmp_path):
    binary = fake_server(tmp_path, "error: unknown argument: --help\n", status=1)
    with pytest.raises(HarnessError, match=r"--help exited with code 1 \(error: unknown argument: --help\)") as err:
        server_flags(binary)
    assert "\n" not in str(err.value)


def test_a_help_without_options_is_not_llama_server(tmp_path):
    with pytest.raises(HarnessError, match="lists no -m option"):
        server_flags(fake_server(tmp_path, "usage: something else\n"))


def test_a_flag_that_became_a_switch_takes_its_older_form(tmp_path):
    old = server_flags(fake_server(tmp_path, OLD_HELP))
    assert old.arity["-fa"] == 0
    cmd = ["llama-server", "-m", "x.gguf", "-fa", "off", "--no-kv-unified"]
    assert fit_to_build(cmd, old, "1 (old)") == ["llama-server", "-m", "x.gguf", "--no-kv-unified"]
    assert fit_to_build(cmd[:4] + ["on"] + cmd[5:], old, "1 (old)") == [*cmd[:4], "--no-kv-unified"]
    with pytest.raises(HarnessError, match=r"takes -fa with no value \(a switch\), but flash attention .* auto"):
        fit_to_build(cmd[:4] + ["auto"], old, "1 (old)")


def test_a_value_missing_or_extra_is_refused_in_one_line(tmp_path):
    flags = server_flags(fake_server(tmp_path, NEW_HELP))
    with pytest.raises(
        HarnessError, match=r"takes --no-kv-unified with no value \(a switch\), but .* gives it 1 value"
    ):
        fit_to_build(["llama-server", "--no-kv-unified", "yes"], flags, "2 (new)")
    with pytest.raises(HarnessError, match=r"takes -m with 1 value, but .* gives it 0 values"):
        fit_to_build(["llama-server", "-m", "-fa", "on"], flags, "2 (new)")
    cmd = ["llama-server", "-m", "x.gguf", "-fa", "on", "-kvu", "--spec-draft-n-max", "4", "-s", "-1"]
    with pytest.raises(HarnessError, match="has no -s"):
        fit_to_build(cmd, flags, "2 (new)")
    assert fit_to_build(cmd[:-2], flags, "2 (new)") == cmd[:-2]


@pytest.mark.skipif(not RECORDED.is_file(), reason="no recorded llama-server --help")
def test_the_recorded_help_of_the_vendored_llama_server():
    flags = parse_help(RECORDED.read_text())
    assert flags.arity["-fa"] == 1 and flags.arity["--flash-attn"] == 1
    assert flags.arity["-np"] == 1 and flags.arity["--kv-unified"] == 0 and flags.arity["--no-kv-unified"] == 0
    assert flags.arity["--spec-draft-n-max"] == 1 and flags.arity["--slot-save-path"] == 1
    assert {"-fit", "--no-repack", "--no-context-shift", "--metrics", "--no-warmup", "-md", "-ctk"} <= flags
    assert all(f.startswith("-") and f.strip("-") and " " not in f for f in flags)


def test_every_command_line_the_harness_writes_fits_the_vendored_build(tmp_path):
    """The arity check passes every flag the harness gives the vendored llama-server: each speculative preset, each
    mode, and the optional switches."""
    from harness.backends.build import ensure_server
    from harness.backends.server import LlamaServer
    from harness.matrix import SPEC_PRESETS

    build = ensure_server()
    for name, preset in SPEC_PRESETS.items():
        if "spec-draft-sampling" in preset.options:  # b11434 and newer: the vendored build does not serve the cell
            with pytest.raises(Unservable, match="has no --spec-draft-sampling, which the speculative option"):
                LlamaServer(
                    server_bin=build.server_bin, model=tmp_path / "m.gguf", port=1, spec=preset.options
                ).command()
            # ... unless the value is what the build does anyway (`--spec-draft-sampling greedy`): the flag is left out
            greedy = {**preset.options, "spec-draft-sampling": "greedy"}
            command = LlamaServer(server_bin=build.server_bin, model=tmp_path / "m.gguf", port=1, spec=greedy).command()
            assert "--spec-draft-sampling" not in command
            continue
        for kv_unified in (False, True):
            server = LlamaServer(
                server_bin=build.server_bin,
                model=tmp_path / "m.gguf",
                draft_model=tmp_path / "d.gguf",
                port=1,
                kv_unified=kv_unified,
                repack=False,
                context_shift=kv_unified,
                cache_prompt=False,
                slot_save_path=tmp_path,
                metrics=True,
                warmup=False,
                spec=dict(preset.options),
            )
            cmd = server.command()
            assert cmd[cmd.index("-fa") + 1] == "off", name


def test_a_gpu_build_offloads_every_layer_explicitly_and_a_cpu_build_passes_no_ngl(tmp_path):
    """`-ngl all` (and the draft's `--spec-draft-ngl all`) on a GPU build, said in the backend's facts; nothing on a
    CPU build, where llama-server would only warn that it ignores the flag. The command fits the vendored build."""
    from dataclasses import replace

    from harness.backends.build import ensure_server
    from harness.backends.server import LlamaServer
    from harness.backends.server_backend import ServerBackend, gpu_layers

    build = ensure_server()
    assert gpu_layers(build) is None and "gpu_layers" not in ServerBackend(build).environment()
    cuda = replace(build, backend="cuda")
    assert gpu_layers(cuda) == "all" and ServerBackend(cuda).environment()["gpu_layers"] == "all"
    model, draft = tmp_path / "m.gguf", tmp_path / "d.gguf"
    server = LlamaServer(server_bin=build.server_bin, model=model, draft_model=draft, port=1, gpu_layers="all")
    cmd = server.command()
    assert cmd[cmd.index("-ngl") + 1] == "all" and cmd[cmd.index("--spec-draft-ngl") + 1] == "all"
    plain = LlamaServer(server_bin=build.server_bin, model=tmp_path / "m.gguf", port=1).command()
    assert "-ngl" not in plain

"""The CLI reference (`cli.md`), from the argparse parsers (`harness.cli.build_parser`)."""

import argparse
import textwrap

from harness.docgen.common import USAGE_WIDTH, _code, _header, _paragraphs, _sanitize, _table, _text


def _metavar(action: argparse.Action, usage: bool = False) -> str:
    """An option's argument as the usage line shows it (a long list of choices as its name) or, with
    usage=False, as the options table does (every choice)."""
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        return action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    if action.choices is not None:
        choices = "|".join(str(c) for c in action.choices)
        if not usage or len(choices) <= 40:
            return choices
    return action.dest.upper() if action.option_strings else action.dest


def _usage_item(action: argparse.Action) -> str:
    meta = _metavar(action, usage=True)
    if not action.option_strings:
        item = {"?": f"[{meta}]", "*": f"[{meta} ...]", "+": f"{meta} [{meta} ...]"}.get(action.nargs, meta)
        return item
    opt = action.option_strings[-1]
    if action.nargs == "+":
        body = f"{opt} {meta} [{meta} ...]"
    elif action.nargs == "*":
        body = f"{opt} [{meta} ...]"
    else:
        body = f"{opt} {meta}".rstrip()
    return body if action.required else f"[{body}]"


def _visible(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        and not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and "-h" not in a.option_strings
    ]


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, in the order they were added, aliases left out."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            seen: set[int] = set()
            for name, sub in action.choices.items():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    out.append((name, helps.get(name, ""), sub))
    return out


def _wrap(path: str, items: list[str]) -> str:
    """A usage line wrapped between items (never inside one) at USAGE_WIDTH, continued under the first item."""
    lines, line = [], path
    for item in items:
        if len(line) + 1 + len(item) > USAGE_WIDTH and line.strip() != path:
            lines.append(line)
            line = " " * len(path)
        line += " " + item
    return "\n".join([*lines, line])


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        params = {k: v for k, v in vars(action).items()}
        params.update(prog=prog)
        if params.get("choices") is not None:
            params["choices"] = ", ".join(map(str, params["choices"]))
        try:
            text = text % params
        except (KeyError, TypeError, ValueError):
            pass
    if isinstance(action, argparse._AppendAction) and "repeatable" not in text:
        text += " (repeatable)"
    return text


def _command(path: str, help_text: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    actions = _visible(parser)
    subs = _subcommands(parser)
    items = [_usage_item(a) for a in actions if a.option_strings] + [
        _usage_item(a) for a in actions if not a.option_strings
    ]
    if subs:
        items.append("|".join(name for name, _, _ in subs) + " ...")
    usage = _wrap(path, items)
    out = [f"{'#' * level} `{path}`\n"]
    if help_text:
        out.append(_text(help_text[0].upper() + help_text[1:]) + ".\n")
    if parser.description:
        out.append(_paragraphs(parser.description) + "\n")
    out.append(f"```\n{usage}\n```\n")
    rows = [
        [
            ", ".join(_code(o) for o in a.option_strings) or _code(a.dest),
            _code(_metavar(a)) if _metavar(a) else "",
            _text(_help(a, path)),
        ]
        for a in actions
    ]
    if rows:
        out.append(_table(["option", "argument", "what"], rows))
    for name, sub_help, sub in subs:
        out += _command(f"{path} {name}", sub_help, sub, min(level + 1, 4))
    return out


def cli_page() -> str:
    from harness.cli import build_parser

    parser = build_parser()
    subs = _subcommands(parser)
    out = [_header("Command line", "the argparse parsers (`harness.cli.build_parser`)")]
    out.append(_paragraphs(parser.description or "") + "\n")
    out.append(
        "`specharness` with no command runs `specharness run`. Every command exits 0 on success, 2 on bad input or "
        "configuration (one line naming the thing and the fix), 130 when interrupted (143 by SIGTERM).\n"
    )
    out.append(_table(["command", "what"], [[f"[`{n}`](#specharness-{n})", _text(h)] for n, h, _ in subs]))
    out.append(
        f"```\n{textwrap.fill(' '.join(['specharness', *map(_usage_item, _visible(parser))]), USAGE_WIDTH)}"
        " COMMAND ...\n```\n"
    )
    out.append(
        _table(
            ["option", "argument", "what"],
            [
                [", ".join(_code(o) for o in a.option_strings), "", _text(_help(a, "specharness"))]
                for a in _visible(parser)
            ],
        )
    )
    for name, help_text, sub in subs:
        out += _command(f"specharness {name}", help_text, sub, 2)
    return _sanitize("\n".join(out))

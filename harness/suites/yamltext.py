"""YAML reading for suites and known-failures files: PyYAML's safe loader, in C (libyaml) where PyYAML was built
with it. The pure-Python loader takes 0.75 s for suites/known-failures.yaml, read by every pytest worker and every
`specharness` command; the C one 0.05 s, the same data. A text the C loader refuses is read again by the Python
one, so an error names the line and problem in PyYAML's words as before (libyaml words and places some
differently)."""

import yaml

_FAST = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


def load(text: str):
    """`yaml.safe_load(text)`."""
    try:
        return yaml.load(text, Loader=_FAST)  # noqa: S506 (a safe loader)
    except yaml.YAMLError:
        return yaml.safe_load(text)


def compose(text: str) -> yaml.Node | None:
    """`yaml.compose(text)` with the safe loader: the node tree, with each node's line (`start_mark`)."""
    try:
        return yaml.compose(text, Loader=_FAST)
    except yaml.YAMLError:
        return yaml.compose(text, Loader=yaml.SafeLoader)

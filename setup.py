"""The wheel carries this repository's suites (with their grammars and known-failures file) and fixtures
(baselines, calibration), which the repository keeps at its top level, as `harness/bundled/suites` and
`harness/bundled/fixtures` (harness.suites.suites_dir finds them there). An editable install reads the
checkout's own directories instead. The metadata is in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

BUNDLED = ("suites", "fixtures")


class BuildWithSuites(build_py):
    """build_py, plus a copy of the top-level suites and fixtures into the built package."""

    def run(self):
        super().run()
        if not self.editable_mode:
            for name in BUNDLED:
                self.copy_tree(
                    str(Path(__file__).parent / name), str(Path(self.build_lib) / "harness" / "bundled" / name)
                )


setup(cmdclass={"build_py": BuildWithSuites})

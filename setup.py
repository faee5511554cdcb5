"""Build hook: generate the protobuf/gRPC stubs from protos/ into gpuloom/v1/.

Everything else about the package lives in pyproject.toml. The stubs are never committed;
see protos/README.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "protos"))

from generate import generate_stubs  # noqa: E402

# The import package `gpuloom` is spread over three top-level folders of the repository.
PACKAGE_ROOTS = {"gpuloom": "gpuloom", "gpuloom.services": "services", "gpuloom.clients": "clients"}


def find_packages() -> list[str]:
    packages = []
    for prefix, folder in PACKAGE_ROOTS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder)
            packages.append(".".join([prefix, *relative.parts]))
    return packages


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        # In editable mode the stubs land in the source tree (git ignores them); in a
        # regular build they land in build_lib next to the copied sources.
        target = ROOT if self.editable_mode else Path(self.build_lib)
        generate_stubs(out_dir=target)
        super().run()


setup(
    packages=find_packages(),
    package_dir=PACKAGE_ROOTS,
    cmdclass={"build_py": BuildPyWithProtos},
)

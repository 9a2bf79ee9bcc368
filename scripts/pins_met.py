"""Exit 0 when every pin of pyproject.toml (dependencies and the dev extra) and every pin given as an argument is
installed at its pinned version; exit 1 otherwise (scripts/setup.sh then runs pip)."""

import importlib.metadata as md
import sys
import tomllib

from packaging.requirements import Requirement

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in map(Requirement, [*project["dependencies"], *project["optional-dependencies"]["dev"], *sys.argv[1:]]):
    try:
        installed = md.version(req.name)
    except md.PackageNotFoundError:
        sys.exit(1)
    if not req.specifier.contains(installed, prereleases=True):
        sys.exit(1)

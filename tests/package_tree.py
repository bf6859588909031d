"""Where each package of the distribution lives in the checkout, read from ``pyproject.toml``
(``[tool.setuptools] packages`` and ``package-dir``): the core folder ``optimizer_core/`` is the
package ``graphtrim``, ``operators/airflow`` is ``graphtrim.airflow``, and so on.

``python -m tests.package_tree DEST`` links the package as it installs (``DEST/graphtrim`` with
``airflow/`` and ``kubeflow/`` inside) for tools that map module names to folders one to one,
such as mypy (``make typecheck``)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def package_dirs() -> dict[str, Path]:
    """``package name -> its folder`` for every package the wheel holds."""
    config = _setuptools()
    roots: dict[str, str] = config["package-dir"]
    out: dict[str, Path] = {}
    for package in config["packages"]:
        parts = package.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in roots:
                out[package] = REPO / roots[prefix] / Path(*parts[i:])
                break
        else:
            out[package] = REPO / Path(*parts)
    return out


def module_files() -> dict[str, Path]:
    """``module name -> file`` for every module of the distribution (a package is its
    ``__init__.py``)."""
    found: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def link_tree(dest: Path) -> Path:
    """``dest`` made anew with a folder per package and a link per module file."""
    if dest.exists():
        shutil.rmtree(dest)
    for name, path in module_files().items():
        parts = name.split(".")  # a package's module is its __init__.py, inside its folder
        folder = dest.joinpath(*(parts if path.stem == "__init__" else parts[:-1]))
        folder.mkdir(parents=True, exist_ok=True)
        os.symlink(path, folder / path.name)
    return dest


if __name__ == "__main__":
    print(link_tree(Path(sys.argv[1]).resolve()))

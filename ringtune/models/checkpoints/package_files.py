"""Data files shipped inside installed packages, found without importing the package (whose ``__init__`` may import
what is deliberately not installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_file(module: str, package: str, relative: str, *, install_hint: str | None = None) -> Path:
    """Path of ``relative`` inside the installed package ``package`` (import name ``module``).

    Raises ``FileNotFoundError`` when the package is not installed (naming ``install_hint``, default
    ``pip install <package>``) or holds no such file (naming the folders searched, then ``re<install_hint>``
    where one is given).
    """
    spec = importlib.util.find_spec(module)
    hint = f"pip install {package}" if install_hint is None else install_hint
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {package!r} (module {module}) is not installed; {hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / relative
        if path.is_file():
            return path
    again = "" if install_hint is None else f"; re{install_hint}"
    raise FileNotFoundError(
        f"{relative} not found in {list(spec.submodule_search_locations)} of package {package!r}{again}"
    )

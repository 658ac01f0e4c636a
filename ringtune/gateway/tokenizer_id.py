"""``get_info``'s ``model_data.tokenizer_id``: a name a client on another machine can load.

The SDK (``TrainingClient.get_tokenizer``) and the cookbook pass ``tokenizer_id`` to
``transformers.AutoTokenizer.from_pretrained`` on the client's machine, so a directory of the server's disk only
works for a client on the same machine. :func:`remote_tokenizer_id` answers, in this order:

1. ``ringtune serve --tokenizer-id ID`` (``GatewayConfig.tokenizer_id``), as given;
2. the Hugging Face hub id of the served tokenizer when its directory tells it: ``name_or_path`` in
   ``tokenizer_config.json``, ``_name_or_path`` in ``config.json`` (when it is ``org/name``, not a path), or a
   hub cache directory ``.../models--<org>--<name>/snapshots/<rev>``;
3. the tokenizer's absolute local directory (clients on the same machine, or with the same path, can load it);
4. None (no tokenizer known: ``get_tokenizer`` then fails on the client, naming the model).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
"""A hub repository id, ``<org>/<name>``."""

HUB_CACHE_RE = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/[^/]+/?$")
"""A directory of the hub cache: ``models--<org>--<name>/snapshots/<revision>``."""


def _hub_id(value: object) -> str | None:
    if isinstance(value, str) and HUB_ID_RE.match(value) and not Path(value).exists():
        return value
    return None


def hub_tokenizer_id(tokenizer_dir: str | Path) -> str | None:
    """The hub id ``tokenizer_dir`` says it came from (module docstring, point 2), or None."""
    directory = Path(tokenizer_dir)
    for file, key in (("tokenizer_config.json", "name_or_path"), ("config.json", "_name_or_path")):
        try:
            found = _hub_id(json.loads((directory / file).read_text()).get(key))
        except (OSError, ValueError, AttributeError):
            continue
        if found is not None:
            return found
    cached = HUB_CACHE_RE.search(directory.resolve().as_posix())
    return f"{cached.group(1)}/{cached.group(2)}" if cached else None


def remote_tokenizer_id(override: str | None, tokenizer_dir: str | None) -> str | None:
    """``model_data.tokenizer_id`` (module docstring): ``override``, else the hub id of ``tokenizer_dir``, else
    ``tokenizer_dir`` itself, else None."""
    if override:
        return override
    if tokenizer_dir is None:
        return None
    return hub_tokenizer_id(tokenizer_dir) or tokenizer_dir

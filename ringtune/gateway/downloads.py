"""Signed download URLs for external weights (``save_weights_external`` + ``get_external_weights_urls``).

SDK 0.38 downloads weights in two steps: ``TrainingClient.save_weights_external(name)`` writes an export under
``tinker://<run>/external_weights/<name>`` (here: the HF checkpoint directory ``export_for_sampler`` writes; a
LoRA run's also holds its PEFT adapter), then ``RestClient.get_external_weights_urls(path)`` returns one signed
URL per file, which ``tinker checkpoint download`` and the cookbook's ``weights.download`` fetch with plain HTTP
GETs (no API key). Here each URL points back at this gateway:

    <base>/api/v1/ringtune/download/<run_id>/<name>/<relative file path>?expires=<unix s>&sig=<hex>

``sig`` is an HMAC-SHA256, under a secret drawn when the server starts, of the run, name, file and expiry: a URL
names one file of one export, is refused after ``expires`` (:data:`URL_LIFETIME_S` after signing) or after a
restart (a new secret), and cannot be bent to another path. The download route is therefore open (no
``X-API-Key``), like ``healthz``; everything else about it is checked here.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

URL_LIFETIME_S = 3600
"""Seconds a signed URL stays valid (the cookbook re-signs when its URLs near expiry)."""

DOWNLOAD_PREFIX = "/api/v1/ringtune/download/"
"""The open route the signed URLs point at."""


class DownloadSigner:
    """Signs and checks download URLs with one secret per server start (module docstring)."""

    def __init__(self, secret: bytes | None = None, clock=time.time) -> None:
        self.secret, self.clock = secret or secrets.token_bytes(32), clock

    def _sig(self, run_id: str, name: str, file: str, expires: int) -> str:
        message = "\0".join((run_id, name, file, str(expires))).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def urls(self, base_url: str, run_id: str, name: str, directory: Path) -> tuple[dict[str, str], datetime]:
        """``({relative file path: signed URL}, expiry)`` for every regular file under ``directory``."""
        expires = int(self.clock()) + URL_LIFETIME_S
        root = directory.resolve()
        out = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            file = path.relative_to(root).as_posix()
            where = f"{quote(run_id, safe='')}/{quote(name, safe='')}/{quote(file)}"
            query = f"expires={expires}&sig={self._sig(run_id, name, file, expires)}"
            out[file] = f"{base_url.rstrip('/')}{DOWNLOAD_PREFIX}{where}?{query}"
        return out, datetime.fromtimestamp(expires, UTC)

    def check(self, run_id: str, name: str, file: str, expires: str, sig: str) -> str | None:
        """None if the URL's signature and expiry are good, else why not (for a 403)."""
        if not expires.isdigit():
            return "expires must be a unix time"
        if int(expires) < self.clock():
            return "the signed URL has expired; ask get_external_weights_urls for new ones"
        if not hmac.compare_digest(self._sig(run_id, name, file, int(expires)), sig):
            return "bad signature (a URL of another file, or signed before the server restarted)"
        return None


def confined_file(directory: Path, file: str) -> Path | None:
    """``directory / file`` if it is a regular file inside ``directory`` (symlinks resolved), else None."""
    root = directory.resolve()
    path = (root / file).resolve()
    return path if path.is_relative_to(root) and path.is_file() else None

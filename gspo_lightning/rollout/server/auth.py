"""The rollout server's shared secret: who may make it generate, load weights or read files.

Server and trainer hold the same secret, from ``GSPO_SERVER_TOKEN`` in their environment or
from a file (``gspo serve --token_file``, ``RemoteEngine(token_file=...)``; never a value in a
config file, which is saved to the run folder). Every request but ``GET /health`` carries it
as ``Authorization: Bearer <secret>``; the server compares it in constant time. A server
always has one, loopback included (other users share machines): ``gspo serve`` given none
makes one and writes it to a file only its user can read (:func:`write_secret_file`), and a
trainer that starts its own server gives it a fresh one. The secret authenticates, it does
not encrypt: across machines, put the server behind a TLS proxy or an SSH tunnel
(docs/scaling.md#security).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
from pathlib import Path
from typing import Mapping, Optional

from gspo_lightning.errors import ConfigError

SECRET_ENV = "GSPO_SERVER_TOKEN"
MIN_SECRET_CHARS = 16
HOW_TO_MAKE_ONE = "e.g. `export GSPO_SERVER_TOKEN=$(openssl rand -hex 32)` on the server and the trainer"


def read_secret(token_file: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The secret from ``token_file`` when given, else from ``$GSPO_SERVER_TOKEN``; ``None`` if neither.

    Surrounding whitespace (a file's last newline) is not part of it; one shorter than
    :data:`MIN_SECRET_CHARS` is refused (a guessable secret guards nothing)."""
    if token_file:
        path = Path(token_file).expanduser()
        try:
            secret, where = path.read_text().strip(), f"token file {path}"
        except OSError as error:
            raise ConfigError(f"cannot read the rollout server's token file {path}: {error.strerror}") from None
    else:
        secret, where = environ.get(SECRET_ENV, "").strip(), f"${SECRET_ENV}"
        if not secret:
            return None
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"the rollout server secret in {where} has {len(secret)} characters; use at least "
                         f"{MIN_SECRET_CHARS} random ones ({HOW_TO_MAKE_ONE})")
    if not secret.isascii() or any(c.isspace() or not c.isprintable() for c in secret):
        raise ConfigError(f"the rollout server secret in {where} holds whitespace, control or non-ASCII characters: it "
                         f"travels in an HTTP header; use letters and digits ({HOW_TO_MAKE_ONE})")
    return secret


def bearer(secret: Optional[str]) -> dict[str, str]:
    """The header a client sends (none without a secret)."""
    return {"Authorization": f"Bearer {secret}"} if secret else {}


def make_secret() -> str:
    """A fresh secret: 256 random bits as hex."""
    return secrets.token_hex(32)


def secrets_folder() -> Path:
    """Where ``gspo serve`` writes a secret it made: ``$XDG_RUNTIME_DIR/gspo-lightning`` (a
    per-user folder the system clears at logout) or ``~/.cache/gspo-lightning/secrets``, 0700."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "gspo-lightning" if runtime and os.path.isdir(runtime) else \
        Path.home() / ".cache" / "gspo-lightning" / "secrets"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    folder.chmod(0o700)
    return folder


def write_secret_file(secret: str, name: str) -> Path:
    """``secret`` in ``secrets_folder()/name``, created readable and writable by this user only."""
    path = secrets_folder() / name
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(secret + "\n")
    return path


def authorized(header: Optional[str], secret: Optional[str]) -> bool:
    """Whether an ``Authorization`` header carries ``secret`` (never, without one).

    ``hmac.compare_digest`` takes as long for a wrong secret as for a nearly right one, so
    the time of a refusal tells nothing about the secret."""
    if not secret:
        return False
    scheme, _, given = (header or "").partition(" ")
    # compared even for a wrong scheme: a refusal takes the same time whatever was sent
    return hmac.compare_digest(given.strip().encode(), secret.encode()) and scheme.lower() == "bearer"


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost``, 127.0.0.0/8, ``::1``).
    Any other name counts as reachable from elsewhere, ``""`` and ``0.0.0.0`` (every interface) too."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = ["MIN_SECRET_CHARS", "SECRET_ENV", "authorized", "bearer", "is_loopback", "make_secret", "read_secret",
           "secrets_folder", "write_secret_file"]

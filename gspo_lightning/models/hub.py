"""Is the Hugging Face hub reachable? Asked once, before a hub id is loaded.

Without a network the hub client retries each request with growing pauses (ten
"Retrying in Ns" lines, most of a minute) before transformers gives up. One short connection
attempt to the hub's host answers first: unreachable, the process goes offline
(``HF_HUB_OFFLINE``): a model in the local cache loads from it at once, a missing one fails
at once with the loader's one-line error.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Optional
from urllib.parse import urlparse

PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@functools.lru_cache(maxsize=None)
def hub_reachable(endpoint: Optional[str] = None, timeout: float = 3.0) -> Optional[bool]:
    """``True`` / ``False``: a TCP connection to the hub's host (``HF_ENDPOINT`` when set) did or
    did not open within ``timeout`` seconds. ``None``: not asked (offline already, or a proxy
    stands between, which a direct connection does not test)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(os.environ.get(v) for v in PROXY_VARIABLES):
        return None
    url = urlparse(endpoint or constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:  # no name resolution, refused, unreachable, timed out
        return False


def go_offline() -> None:
    """The hub client and transformers stop asking the hub: the environment variable for
    whatever starts later (a rollout server's engine) and the constant the running client reads."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


__all__ = ["go_offline", "hub_reachable"]

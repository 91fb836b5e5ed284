"""A rollout server: any :class:`~gspo_lightning.rollout.engine.RolloutEngine` behind a small
HTTP + JSON API, in five parts (the ``gspo serve`` command that starts one is ``run/serve.py``):

- ``host.py``: :class:`RolloutServer`, hosting an engine: the model's identity, weight loads
  and generations under one lock (a push waits for the generation in flight, and a
  generation never sees two versions);
- ``lease.py``: :class:`SessionLease`, which trainer holds the server;
- ``auth.py``: the shared secret (``GSPO_SERVER_TOKEN``) that every request but ``/health`` carries;
- ``limits.py``: :class:`ServerLimits`, what one request may ask, and the checks of request bodies;
- ``http.py``: the routes (the API table), the request handler and the hardened HTTP server.
"""

from gspo_lightning._imports import lazy_exports

EXPORTS = {
    **dict.fromkeys(["RolloutServer", "ServerSpec", "VersionError", "DEFAULT_ENGINE", "build_engine", "fingerprint",
                     "model_fingerprint", "spec_json"], "host"),
    **dict.fromkeys(["SessionError", "SessionLease"], "lease"),
    **dict.fromkeys(["ROUTES", "RolloutHTTPServer", "http_server"], "http"),
    **dict.fromkeys(["SECRET_ENV", "authorized", "is_loopback", "read_secret"], "auth"),
    **dict.fromkeys(["BadRequest", "ServerLimits"], "limits"),
}
__getattr__, __dir__ = lazy_exports(__name__, EXPORTS)
__all__ = sorted(EXPORTS)

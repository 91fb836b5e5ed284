"""``gspo serve --config cfg.yaml [--host H] [--port P]``: host the engine a ``gspo fit`` config
names (``model.engine``; for a config whose engine is the client, ``RemoteEngine``, its
``server_engine``) on the config's model. ``gspo fit`` starts one itself, as a child process,
when the client engine is given no URL (``--spec``). Arguments are parsed, and the secret
read, before torch is imported: ``gspo serve --help`` answers at once, and a server that
would be reachable without a secret stops before it loads anything.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from gspo_lightning.rollout.server.host import ServerSpec


def spec_from_config(config: dict) -> "ServerSpec":
    """The server a ``gspo fit`` config describes: its model, and the engine to host."""
    from gspo_lightning.rollout.server.host import DEFAULT_ENGINE, ServerSpec

    from gspo_lightning.models.settings import Policy
    from gspo_lightning.rollout.settings import RolloutSettings
    from gspo_lightning.training.config import nest_flat_keys

    model, _ = nest_flat_keys(config.get("model") or {})  # a config of earlier releases: its flat keys in blocks
    data = config.get("data") or {}
    # the blocks' own defaults: what gspo fit would run with
    policy, rollout = Policy(**model.get("policy") or {}), RolloutSettings(**model.get("rollout") or {})
    engine = model.get("engine") or dict(DEFAULT_ENGINE)
    if str(engine.get("class_path", "")).endswith("RemoteEngine"):
        engine = (engine.get("init_args") or {}).get("server_engine") or dict(DEFAULT_ENGINE)
    seed = rollout.rollout_seed
    return ServerSpec(
        model_name_or_path=model.get("model_name_or_path", "builtin:tiny-echo"), dtype=policy.dtype,
        trust_remote_code=policy.trust_remote_code, prompt_length=data.get("prompt_length"),
        response_length=rollout.response_length,
        seed=int(seed if seed is not None else (config.get("seed_everything") or 0)), engine=engine,
        lora=served_adapters(model),
    )


def served_adapters(model: dict) -> Optional[dict]:
    """The LoRA config a trainer with ``model`` pushes adapters of (``LoRA.serving_config()``),
    or None when it pushes full weights (no ``model.lora``, or ``lora_sync: merged``)."""
    lora = model.get("lora")
    if not lora:
        return None
    engine = model.get("engine") or {}
    if str(engine.get("class_path", "")).endswith("RemoteEngine") and \
            (engine.get("init_args") or {}).get("lora_sync") == "merged":
        return None
    from gspo_lightning.models.lora import LoRA

    return LoRA(**lora).serving_config()


def weights_root_from_config(config: dict) -> Optional[str]:
    """The folder a config's client engine pushes weights to (its ``FolderTransport`` path), if any."""
    engine = (config.get("model") or {}).get("engine") or {}
    transport = (engine.get("init_args") or {}).get("transport") or {}
    return (transport.get("init_args") or {}).get("path") if isinstance(transport, dict) else None


SECURITY = """security: every request but GET /health must carry the server's secret ($GSPO_SERVER_TOKEN, or
--token_file), as the trainer does from its own $GSPO_SERVER_TOKEN or model.engine.init_args.token_file.
Given none, the server makes one and writes it to a file only you can read (its path is printed).
The secret authenticates, it does not encrypt: across machines use an SSH tunnel, or a TLS proxy in
front of a loopback server (docs/scaling.md#security)."""


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gspo serve", description="Serve rollouts for gspo fit (rollout/server/).",
                                     epilog=SECURITY, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a gspo fit config: its model.* and data.prompt_length")
    source.add_argument("--spec", help="a ServerSpec as JSON (what gspo fit writes for the server it starts)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1); any other needs a secret (see security below)")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--token_file", help="a file holding the secret (else $GSPO_SERVER_TOKEN)")
    parser.add_argument("--weights_root", help="the only folder under which pushed weight folders are read (default: "
                                               "the config's FolderTransport path, else /dev/shm or the temporary directory)")
    parser.add_argument("--lease_s", type=float, default=120.0, help="a trainer idle this long loses its hold")
    limits = parser.add_argument_group("limits (a request above one is refused with status 400 / 413 / 503)")
    limits.add_argument("--request_timeout_s", type=float, default=10.0,
                        help="a request must be received whole within this long, else its connection is dropped")
    limits.add_argument("--reply_timeout_s", type=float, default=300.0,
                        help="a reply must be sent within this long, else its connection is dropped")
    limits.add_argument("--max_connections", type=int, default=32, help="connections served at once; more get 503")
    limits.add_argument("--max_body_mb", type=float, default=64.0, help="largest request body")
    limits.add_argument("--max_prompts", type=int, default=4096, help="prompts per generation request")
    limits.add_argument("--max_prompt_tokens", type=int, default=32768, help="tokens per prompt")
    limits.add_argument("--max_n", type=int, default=256, help="responses per prompt")
    limits.add_argument("--max_responses", type=int, default=65536, help="responses per request (prompts x n)")
    limits.add_argument("--max_new_tokens", type=int, help="new tokens per response (default: the config's response_length)")
    parser.add_argument("--port_file", help=argparse.SUPPRESS)  # where a child server tells its port
    parser.add_argument("--parent_pid", type=int, help=argparse.SUPPRESS)  # exit when this process is gone
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from gspo_lightning.rollout.server.auth import SECRET_ENV, is_loopback, make_secret, read_secret, write_secret_file

    try:
        secret = read_secret(args.token_file)
    except ValueError as error:
        raise SystemExit(f"gspo serve: error: {error}") from None
    if secret is None and not is_loopback(args.host):
        raise SystemExit(f"gspo serve: error: --host {args.host} serves other machines, and no secret is set: set "
                         f"{SECRET_ENV} (or --token_file) here and on the trainer, and reach the server through an SSH "
                         "tunnel or a TLS proxy (docs/scaling.md#security)")
    secret_file = None
    if secret is None:  # never without one: other users of this machine reach loopback too
        secret = make_secret()
        secret_file = write_secret_file(secret, f"serve-{os.getpid()}.token")
    from gspo_lightning.rollout.server.host import RolloutServer, ServerSpec  # torch from here on
    from gspo_lightning.rollout.server.http import http_server
    from gspo_lightning.rollout.server.limits import ServerLimits

    weights_root = args.weights_root
    if args.config:
        import yaml

        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"gspo serve: error: no config file {path}")
        config = yaml.safe_load(path.read_text()) or {}
        spec = spec_from_config(config)
        weights_root = weights_root or weights_root_from_config(config)
    else:
        spec = ServerSpec(**json.loads(Path(args.spec).read_text()))
    try:
        limits = ServerLimits(request_timeout_s=args.request_timeout_s, reply_timeout_s=args.reply_timeout_s,
                              max_connections=args.max_connections,
                              max_body_mb=args.max_body_mb, max_prompts=args.max_prompts,
                              max_prompt_tokens=args.max_prompt_tokens, max_n=args.max_n,
                              max_responses=args.max_responses, max_new_tokens=args.max_new_tokens)
    except ValueError as error:
        raise SystemExit(f"gspo serve: error: {error}") from None
    app = RolloutServer(spec, lease_s=args.lease_s, limits=limits, weights_root=weights_root)
    try:
        app.start()
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"gspo serve: error: {error}") from None
    httpd = http_server(app, args.host, args.port, secret=secret)
    port = httpd.server_address[1]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.parent_pid:
        threading.Thread(target=watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"gspo serve: {spec.model_name_or_path} with {app.identity['engine']} on http://{args.host}:{port} "
          f"(pid {os.getpid()}; secret required; weights read under {app.weights_root})", flush=True)
    if secret_file is not None:
        print(f"gspo serve: no secret was given: made one in {secret_file} (readable by you only); on the trainer set "
              f"model.engine.init_args.token_file={secret_file}", flush=True)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.rename(args.port_file)  # whole or absent: the parent never reads half a number
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    httpd.shutdown()
    httpd.server_close()
    app.close()
    if secret_file is not None:
        secret_file.unlink(missing_ok=True)


def watch_parent(pid: int, stop: threading.Event) -> None:
    """A child server ends with the trainer that started it, even one killed without cleanup."""
    while not stop.wait(1.0):
        if os.getppid() != pid:
            stop.set()


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["main", "served_adapters", "spec_from_config", "weights_root_from_config"]

"""``gspo serve --config cfg.yaml [--host H] [--port P]``: host the engine a ``gspo fit`` config
names (``model.engine``; for a config whose engine is the client, ``RemoteEngine``, its
``server_engine``) on the config's model. ``gspo fit`` starts one itself, as a child process,
when the client engine is given no URL (``--spec``). Arguments are parsed before torch is
imported: ``gspo serve --help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from gspo_lightning.rollout.server.host import ServerSpec


def spec_from_config(config: dict) -> "ServerSpec":
    """The server a ``gspo fit`` config describes: its model, and the engine to host."""
    from gspo_lightning.rollout.server.host import DEFAULT_ENGINE, ServerSpec

    model = config.get("model") or {}
    data = config.get("data") or {}
    engine = model.get("engine") or dict(DEFAULT_ENGINE)
    if str(engine.get("class_path", "")).endswith("RemoteEngine"):
        engine = (engine.get("init_args") or {}).get("server_engine") or dict(DEFAULT_ENGINE)
    seed = model.get("rollout_seed")
    return ServerSpec(
        model_name_or_path=model.get("model_name_or_path", "builtin:tiny-echo"), dtype=model.get("dtype", "float32"),
        trust_remote_code=bool(model.get("trust_remote_code", False)), prompt_length=data.get("prompt_length"),
        response_length=int(model.get("response_length", 256)),
        seed=int(seed if seed is not None else (config.get("seed_everything") or 0)), engine=engine,
    )


def spec_json(spec: "ServerSpec") -> str:
    return json.dumps(asdict(spec))


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gspo serve", description="Serve rollouts for gspo fit (rollout/server/).")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a gspo fit config: its model.* and data.prompt_length")
    source.add_argument("--spec", help="a ServerSpec as JSON (what gspo fit writes for the server it starts)")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to serve other machines")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--lease_s", type=float, default=120.0, help="a trainer idle this long loses its hold")
    parser.add_argument("--port_file", help=argparse.SUPPRESS)  # where a child server tells its port
    parser.add_argument("--parent_pid", type=int, help=argparse.SUPPRESS)  # exit when this process is gone
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from gspo_lightning.rollout.server.host import RolloutServer, ServerSpec  # torch from here on
    from gspo_lightning.rollout.server.http import http_server

    if args.config:
        import yaml

        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"gspo serve: error: no config file {path}")
        spec = spec_from_config(yaml.safe_load(path.read_text()) or {})
    else:
        spec = ServerSpec(**json.loads(Path(args.spec).read_text()))
    app = RolloutServer(spec, lease_s=args.lease_s)
    try:
        app.start()
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"gspo serve: error: {error}") from None
    httpd = http_server(app, args.host, args.port)
    port = httpd.server_address[1]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.parent_pid:
        threading.Thread(target=watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"gspo serve: {spec.model_name_or_path} with {app.identity['engine']} on http://{args.host}:{port} "
          f"(pid {os.getpid()})", flush=True)
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
    app.close()


def watch_parent(pid: int, stop: threading.Event) -> None:
    """A child server ends with the trainer that started it, even one killed without cleanup."""
    while not stop.wait(1.0):
        if os.getppid() != pid:
            stop.set()


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["main", "spec_from_config", "spec_json"]

"""Small helpers shared by several test files."""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from gspo_lightning.rollout.transport import InProcessTransport

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str) -> ModuleType:
    """Import a script of the repository that is not part of the package (``benchmarks/``,
    ``experiments/``), with its folder on ``sys.path`` as when it runs."""
    path = ROOT / relative_path
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CountingTransport(InProcessTransport):
    """Counts the weight pushes that reach the engine."""

    def __init__(self):
        self.sends = 0

    def send(self, weights, version):
        self.sends += 1
        return super().send(weights, version)


def serve_in_thread(model: str, engine: dict, *, prompt_length: int = 8, response_length: int = 10, seed: int = 0,
                    lora=None, **server_kwargs):
    """A rollout server hosting ``engine`` in this process, on a free localhost port:
    ``(server, httpd, url)``; stop with ``httpd.shutdown(); server.close()``."""
    import threading

    from gspo_lightning.rollout.server import RolloutServer, ServerSpec, http_server

    server = RolloutServer(ServerSpec(model, prompt_length=prompt_length, response_length=response_length, seed=seed,
                                      engine=engine, lora=lora), **server_kwargs)
    server.start()
    httpd = http_server(server, "127.0.0.1", 0, secret=os.environ["GSPO_SERVER_TOKEN"])
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return server, httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


_reward_calls = [0]


def reward_that_kills_a_server(prompts, completions, target, **columns):
    """The successor reward; at call ``$GSPO_TEST_KILL_AT_CALL`` it kills ``$GSPO_TEST_KILL_PID``
    (a rollout server dying mid-run)."""
    import os
    import signal

    from gspo_lightning.data.tasks.successor import successor_reward

    _reward_calls[0] += 1
    if _reward_calls[0] == int(os.environ.get("GSPO_TEST_KILL_AT_CALL", "0")):
        os.kill(int(os.environ["GSPO_TEST_KILL_PID"]), signal.SIGKILL)
    return successor_reward(prompts, completions, target, **columns)

"""OpenEnv environment servers through ``OpenEnvEnvironment``, with the real package (``openenv-core``)
on its own example environment; skipped where the package is absent (CI installs ``.[openenv]``)."""

from __future__ import annotations

import pytest

from gspo_lightning.episodes import MultiTurn
from gspo_lightning.models.tiny import build_tokenizer, get_spec
from gspo_lightning.rollout.engine import SamplingParams
from gspo_lightning.rollout.episodes import run_episodes
from tests.helpers_episodes import ScriptedEngine

pytest.importorskip("openenv", reason="pip install -e '.[openenv]'")

QUESTION = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(get_spec("tiny-gsm8k"))  # BPE on GSM8K text: digits and words


def scripted(tokenizer, text: str) -> tuple[list[int], list[float]]:
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return ids, [-0.5] * len(ids)


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    """OpenEnv's own example environment (the echo environment ``openenv init`` writes), served
    as its README says (uvicorn, no Docker) on 127.0.0.1, its sessions raised from 1 to 64 as the
    template's comment asks for concurrent sessions."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    folder = tmp_path_factory.mktemp("openenv")
    openenv = Path(sys.executable).with_name("openenv")
    subprocess.run([str(openenv), "init", "echo_env", "-o", str(folder)], check=True, capture_output=True, timeout=120)
    app = folder / "echo_env" / "server" / "app.py"
    app.write_text(app.read_text().replace("max_concurrent_envs=1,", "max_concurrent_envs=64,"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "echo_env.server.app:app", "--host", "127.0.0.1",
                               "--port", str(port)], cwd=folder, env={**os.environ, "PYTHONPATH": str(folder)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                assert server.poll() is None, server.stderr.read().decode()[-2000:]
                time.sleep(0.1)
        sys.path.insert(0, str(folder))
        yield url
    finally:
        sys.path.remove(str(folder)) if str(folder) in sys.path else None
        server.terminate()
        server.wait(10)


def echo_adapter(url: str, **kwargs):
    from gspo_lightning.episodes import OpenEnvEnvironment

    return OpenEnvEnvironment(url, action_field="message", observation_field="echoed_message", **kwargs)


def test_openenv_rewards_and_observations_equal_the_packages_own_client_on_scripted_actions(echo_server):
    from echo_env import EchoEnv, EchoAction

    from gspo_lightning.episodes.loop import EpisodeLoop

    actions = ["hello", "a longer message", ""]
    with EchoEnv(base_url=echo_server).sync() as client:  # the package's own client, as its README runs it
        first = client.reset()
        expected = [(r.reward, r.done, r.observation.echoed_message) for r in
                    (client.step(EchoAction(message=a)) for a in actions)]
    loop = EpisodeLoop(8)
    for adapter in (echo_adapter(echo_server),  # the generic client (dictionaries)
                    echo_adapter(echo_server, client="echo_env.EchoEnv", action_class="echo_env.EchoAction")):
        episode = adapter.fresh()
        prompt = [{"role": "user", "content": "Say something."}]
        [messages] = loop.gather([lambda: episode.areset({}, prompt)])
        assert messages == [{"role": "user", "content": "Say something." + first.observation.echoed_message}]
        got = []
        for action in actions:
            [result] = loop.gather([lambda a=action: episode.astep({"role": "assistant", "content": a})])
            got.append((result.reward, result.done, result.messages[0]["content"]))
        assert got == expected and got[1][0] == pytest.approx(1.6)  # the echo's reward: 0.1 per character
        assert loop.gather([episode.afinish]) == [{}]


def test_openenv_episodes_in_the_runner_each_hold_their_own_session(echo_server, tokenizer):
    from gspo_lightning.episodes import OpenEnvEnvironment  # noqa: F401 (the adapter under test)

    episodes = MultiTurn(echo_adapter(echo_server, first_observation="drop"), end_of_turn="", max_turns=2)
    episodes.start(tokenizer)
    say = [scripted(tokenizer, text) for text in ("12", "1234", "7", "123")]
    engine = ScriptedEngine([say[:2], say[2:]])  # two episodes, two turns each
    batch = run_episodes(episodes, engine, [QUESTION], [{}], 2, SamplingParams(max_new_tokens=64), seed=1)
    # each turn's reward is the server's (0.1 per character echoed); never done: max_turns ends them
    assert batch.turn_rewards == [pytest.approx([0.2, 0.1]), pytest.approx([0.4, 0.3])]
    assert batch.stats["episode/ended_max_turns"] == 1.0
    assert batch.completions[0][1] == {"role": "user", "content": "12"}  # the echo, as the reply


def test_openenv_refuses_a_server_that_is_not_there_with_what_to_check():
    from gspo_lightning.episodes.loop import EpisodeLoop

    episode = echo_adapter("http://127.0.0.1:9").fresh()  # port 9 (discard): nothing listens
    [error] = EpisodeLoop(2).gather([lambda: episode.areset({}, [{"role": "user", "content": "x"}])])
    assert isinstance(error, RuntimeError)
    assert "the OpenEnv server at http://127.0.0.1:9 did not start an episode" in str(error)

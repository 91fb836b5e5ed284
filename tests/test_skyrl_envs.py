"""SkyRL-gym environments through ``SkyRLEnvironment``, with the real package (``skyrl-gym``) on its
own example environments; skipped where the package is absent (CI installs ``.[skyrl]``)."""

from __future__ import annotations

import json

import pytest
import yaml

from gspo_lightning.episodes import MultiTurn
from gspo_lightning.errors import ConfigError
from gspo_lightning.models.tiny import build_tokenizer, get_spec
from gspo_lightning.rollout.engine import SamplingParams
from gspo_lightning.rollout.episodes import run_episodes
from tests.helpers_episodes import ScriptedEngine, logged

skyrl_gym = pytest.importorskip("skyrl_gym", reason="pip install -e '.[skyrl]'")

QUESTION = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]
ROW = {"prompt": QUESTION, "reward_spec": {"ground_truth": "7"}, "extra_info": {"max_turns": 3}}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(get_spec("tiny-gsm8k"))  # BPE on GSM8K text: it writes "#### 7"


def scripted(tokenizer, text: str) -> tuple[list[int], list[float]]:
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return ids, [-0.5] * len(ids)


def the_package_itself(env_id: str, row: dict, actions: list[str]) -> list[tuple[float, bool, list]]:
    """SkyRL-gym's own environment stepped directly, as SkyRL's generator steps it."""
    from omegaconf import OmegaConf

    env = skyrl_gym.make(env_id, env_config=OmegaConf.create({}), extras=row)
    env.init(list(row["prompt"]))
    outputs = []
    for action in actions:
        out = env.step(action)
        outputs.append((out["reward"], out["done"], out["observations"]))
        if out["done"]:
            break
    return outputs


@pytest.mark.parametrize("env_id", ["gsm8k", "gsm8k_multi_turn"])
def test_skyrl_gym_rewards_and_done_equal_the_packages_own_on_scripted_actions(env_id):
    from gspo_lightning.episodes import SkyRLEnvironment

    actions = ["I think it is 12.\n#### 12", "3 + 4 = 7\n#### 7", "#### 7"]
    expected = the_package_itself(env_id, ROW, actions)
    episode = SkyRLEnvironment(env_id).fresh()
    assert episode.reset(dict(ROW), QUESTION) == QUESTION
    got = []
    for action in actions[:len(expected)]:
        result = episode.step({"role": "assistant", "content": action})
        got.append((result.reward, result.done, result.messages))
    assert got == expected
    if env_id == "gsm8k_multi_turn":  # a wrong answer: the format score, a user message, go on; right: 1 and done
        assert got[0][0] == pytest.approx(0.2 / 3) and not got[0][1] and got[0][2][0]["role"] == "user"
        assert got[1][:2] == (1.0, True)


def test_skyrl_gym_episodes_in_the_runner_carry_its_turn_rewards_and_observations(tokenizer):
    from gspo_lightning.episodes import SkyRLEnvironment

    episodes = MultiTurn(SkyRLEnvironment("gsm8k_multi_turn"), end_of_turn="", max_turns=3)
    episodes.start(tokenizer)
    wrong, right = scripted(tokenizer, "#### 12"), scripted(tokenizer, "#### 7")
    engine = ScriptedEngine([[wrong, right], [right]])  # episode 0 is wrong, then right; episode 1 right at once
    batch = run_episodes(episodes, engine, [QUESTION], [ROW], 2, SamplingParams(max_new_tokens=96), seed=3)
    expected = [reward for reward, _, _ in the_package_itself("gsm8k_multi_turn", ROW, ["#### 12", "#### 7"])]
    assert batch.turn_rewards == [expected, [1.0]]
    assert batch.stats["episode/ended_done"] == 1.0 and batch.stats["episode/turns"] == 1.5
    # the observation (a user message) is in episode 0's sequence, masked out of the loss
    assert batch.completions[0][1]["role"] == "user" and "#### ANSWER" in batch.completions[0][1]["content"]
    assert not batch.loss_mask[0].all() and batch.loss_mask[0, :len(wrong[0])].all()


def test_an_unknown_skyrl_gym_id_names_the_registered_ones():
    from gspo_lightning.episodes import SkyRLEnvironment

    with pytest.raises(ConfigError, match=r"no SkyRL-gym environment 'gsm9k' is registered \(registered: .*gsm8k"):
        SkyRLEnvironment("gsm9k")


def test_a_skyrl_gym_environment_trains_through_gspo_fit_with_no_reward_function(tmp_path):
    from gspo_lightning.cli import main

    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus {b}?"}],
             "reward_spec": {"ground_truth": str(a + b)}, "extra_info": {"max_turns": 2}}
            for a in range(6) for b in range(6)]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {
        "seed_everything": 5,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 2, "limit_val_batches": 0,
                    "num_sanity_val_steps": 0, "enable_progress_bar": False, "default_root_dir": str(tmp_path / "run")},
        "model": {"model_name_or_path": "builtin:tiny-gsm8k", "export_on_fit_end": False,
                  "episodes": {"environment": {"class_path": "gspo_lightning.episodes.SkyRLEnvironment",
                                               "init_args": {"env": "gsm8k_multi_turn"}},
                               "max_turns": 2, "max_turn_tokens": 16, "end_of_turn": ""},
                  "rollout": {"num_return_sequences_in_group": 4, "response_length": 64},
                  "update": {"mini_batch_size": 16}},
        "data": {"path": str(tmp_path / "sums.jsonl"), "rollout_batch_size": 4, "prompt_length": 32, "val_size": 0},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(tmp_path / "cfg.yaml")])
    rows = logged(tmp_path / "run")
    assert len(rows) == 2
    # the run needs no reward function: the environment's rewards are the reward (random weights
    # rarely end a turn, let alone with "#### <n>": the runner test above checks the values)
    assert all(r["reward/mean"] == r.get("reward/environment", 0.0) for r in rows)
    endings = ("done", "max_turns", "budget", "turn_tokens", "environment_error")
    assert all(sum(r[f"episode/ended_{e}"] for e in endings) == pytest.approx(1.0) for r in rows)
    assert all(r["episode/ended_environment_error"] == 0 for r in rows)


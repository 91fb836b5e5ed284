"""Multi-turn episodes in the trainer's other modes: asynchronous rollouts (tagged with the weights
that sampled them, resumed bit for bit with episodes in flight), synchronous stop and resume, a
rollout server, and dynamic sampling. Each run is the tiny lookup task for a few steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from gspo_lightning.data.tasks.lookup import LookupEnvironment
from tests.helpers_episodes import ScriptedEngine, logged, lookup_config
from tests.helpers_fit import metric_rows, policy_state

EPISODE_KEYS = ("episode/turns", "episode/tool_calls", "episode/environment_token_frac", "episode/ended_done")


def episodes_config(folder: Path, **model) -> Path:
    """``lookup_config`` with ``helpers_episodes.RepliesToEveryTurn`` and turns as long as the budget allows."""
    path = lookup_config(folder, **model)
    config = yaml.safe_load(path.read_text())
    config["model"]["episodes"].update({"environment": {"class_path": "tests.helpers_episodes.RepliesToEveryTurn"},
                                        "max_turn_tokens": None})
    path.write_text(yaml.safe_dump(config))
    return path


def resumable_config(folder: Path, max_steps: int, **model) -> Path:
    """``episodes_config`` with a checkpoint every step, the CSV logger in the folder and no validation."""
    path = episodes_config(folder, **model)
    config = yaml.safe_load(path.read_text())
    config["seed_everything"] = 3
    config["trainer"].update({
        "max_steps": max_steps, "limit_val_batches": 0, "enable_model_summary": False,
        "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(folder), "name": "csv"}}],
    })
    config["trainer"].pop("val_check_interval")
    config["checkpoint"] = {"dirpath": str(folder / "ckpt"), "every_n_train_steps": 1}
    path.write_text(yaml.safe_dump(config))
    return path


ASYNC = {
    "max_staleness": 1,
    "engine": {"class_path": "gspo_lightning.rollout.HFCopyEngine", "init_args": {"dtype": "float32"}},
    "off_policy": {"mode": "decoupled", "level": "seq", "method": "truncate"},
}


def assert_same_run(straight: Path, resumed: Path, versions: list[float]) -> dict:
    a, b = policy_state(straight / "ckpt" / "last.ckpt"), policy_state(resumed / "ckpt" / "last.ckpt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows_a, rows_b = metric_rows(straight), metric_rows(resumed)
    assert sorted(rows_a) == sorted(rows_b) == versions
    for version in rows_a:
        assert rows_a[version] == rows_b[version], version
    for row in rows_a.values():
        assert all(key in row for key in EPISODE_KEYS), sorted(row)
    # the runs must have had multi-turn episodes for the comparison to cover them
    assert any(float(row["episode/turns"]) > 1 for row in rows_a.values())
    # at the sampling weights the trainer scores the engine's tokens: a mask or position off by
    # one token (environment tokens taken for the model's) would show here as a large gap
    first = rows_a[min(rows_a)]
    assert float(first["engine/logprob_abs_diff"]) < 1e-5 and float(first["episode/environment_token_frac"]) > 0
    return rows_a


# -- 1. asynchronous episodes -----------------------------------------------------------------------
def test_async_episodes_are_tagged_with_their_weights_and_resume_bit_for_bit(tmp_path):
    from gspo_lightning.cli import main

    straight = tmp_path / "straight"
    main(["fit", "--config", str(resumable_config(straight, 4, **ASYNC))])
    resumed = tmp_path / "resumed"
    main(["fit", "--config", str(resumable_config(resumed, 2, **ASYNC))])
    saved = torch.load(resumed / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    pending = saved["gspo"]["ranks"][0]["pending_rollouts"]["pending"]
    # batch 2 was generated ahead, with the weights of step 1 (version 2: 2 optimizer steps a step)
    assert [(p["index"], p["sampled_at"]) for p in pending] == [(2, 1)]
    episode = pending[0]["rollout"]
    assert episode["turn_of_token"] is not None and episode["episode_stats"]["episode/turns"] >= 1
    main(["fit", "--config", str(resumable_config(resumed, 4, **ASYNC)), "--ckpt_path", str(resumed / "ckpt" / "last.ckpt")])

    rows = assert_same_run(straight, resumed, [2.0, 4.0, 6.0, 8.0])
    # the lag in rollout steps: 0 at the first step, then k = 1; the rollout's policy_version
    # is the weights that sampled it (policy_version logged is the trainer's, after the step)
    assert [float(rows[v]["async/lag"]) for v in sorted(rows)] == [0.0, 1.0, 1.0, 1.0]
    assert all("off_policy/ess" in row for row in rows.values())


def test_an_async_episode_carries_the_version_of_the_weights_that_sampled_it(tmp_path, monkeypatch):
    """The rollout's policy_version is the engine's at sampling time, even when the trainer moved on."""
    from gspo_lightning.cli import main
    from gspo_lightning.rollout import pipeline as pipeline_module

    seen = []
    next_ = pipeline_module.RolloutPipeline.next

    def record(self, step, batch, capture, version=None):
        rollout, stats = next_(self, step, batch, capture, version)
        seen.append((step, rollout.policy_version, stats["async/lag"], rollout.turn_of_token is not None))
        return rollout, stats

    monkeypatch.setattr(pipeline_module.RolloutPipeline, "next", record)
    main(["fit", "--config", str(resumable_config(tmp_path, 3, **ASYNC))])
    assert [s[0] for s in seen] == [0, 1, 2] and all(s[3] for s in seen)
    # 2 optimizer steps per rollout step: step s's rollout was sampled with version 2 * (s - lag)
    assert [(v, lag) for _, v, lag, _ in seen] == [(0, 0), (0, 1), (2, 1)]


class VersionedEngine(ScriptedEngine):
    """The scripted engine, reporting a weights version per call (as a rollout server does)."""

    def __init__(self, script, versions):
        super().__init__(script)
        self.versions = list(versions)

    def generate(self, prompt_ids, n, params, seed):
        generation = super().generate(prompt_ids, n, params, seed)
        generation.weights_version = self.versions.pop(0)
        return generation


def test_an_episode_whose_turns_saw_other_weights_is_as_old_as_its_oldest_turn():
    """A push between turns (rank 0 pushing to a server another rank samples from) gives turns of two
    versions: the rollout's version, and so its lag and its off-policy correction, is the older."""
    from gspo_lightning.models.tiny import build_tokenizer, get_spec
    from gspo_lightning.episodes.multi_turn import MultiTurn
    from gspo_lightning.rollout.episodes import run_episodes
    from gspo_lightning.rollout.engine import SamplingParams
    from tests.helpers_episodes import ANSWER, CALL, GUESS, ROW

    tokenizer = build_tokenizer(get_spec("tiny-lookup"))
    episodes = MultiTurn(LookupEnvironment(), end_of_turn="")
    episodes.start(tokenizer)
    engine = VersionedEngine([[CALL, GUESS], [ANSWER]], versions=[6, 8])
    batch = run_episodes(episodes, engine, ["find c"], [ROW], 2, SamplingParams(max_new_tokens=12), seed=0)
    assert batch.stats["episode/turns"] == 1.5  # the second turn ran, with version 8
    assert batch.generation.weights_version == 6
    engine = VersionedEngine([[GUESS, GUESS]], versions=[None])  # an engine that reports nothing: its own version
    assert run_episodes(episodes, engine, ["find c"], [ROW], 2, SamplingParams(max_new_tokens=12), seed=0).generation.weights_version is None


# -- 2. synchronous stop and resume ---------------------------------------------------------------
def test_sync_episodes_stop_and_resume_bit_for_bit(tmp_path):
    from gspo_lightning.cli import main

    straight = tmp_path / "straight"
    main(["fit", "--config", str(resumable_config(straight, 4))])
    resumed = tmp_path / "resumed"
    main(["fit", "--config", str(resumable_config(resumed, 2))])
    main(["fit", "--config", str(resumable_config(resumed, 4)), "--ckpt_path", str(resumed / "ckpt" / "last.ckpt")])
    rows = assert_same_run(straight, resumed, [2.0, 4.0, 6.0, 8.0])
    assert all(float(row["engine/logprob_abs_diff"]) < 1e-5 for row in rows.values())  # synchronous: always on-policy


# -- 3. a rollout server --------------------------------------------------------------------------
def test_a_rollout_server_serves_episodes_from_token_ids_without_a_gap(tmp_path, monkeypatch):
    """Later turns go to the server as token ids (prompt, sampled turns, tool replies), never text;
    the server's log-probs are the trainer's, as with the colocated engine."""
    from gspo_lightning.cli import main
    from gspo_lightning.rollout.remote import RemoteEngine
    from tests.helpers import serve_in_thread
    from tests.helpers_episodes import TOOL

    app, httpd, url = serve_in_thread("builtin:tiny-lookup", {"class_path": "gspo_lightning.rollout.HFEngine"},
                                      prompt_length=8, response_length=12)
    requests = []
    send = RemoteEngine._generate_on

    def record(self, url, prompts, seed, n, params, version):
        requests.append((prompts, n))
        return send(self, url, prompts, seed, n, params, version)

    monkeypatch.setattr(RemoteEngine, "_generate_on", record)
    try:
        engine = {"class_path": "gspo_lightning.rollout.RemoteEngine", "init_args": {"urls": [url]}}
        main(["fit", "--config", str(episodes_config(tmp_path, engine=engine, old_logprobs="engine")), "--seed_everything", "7"])
    finally:
        httpd.shutdown()
        app.close()
    rows = logged(tmp_path)
    assert len(rows) == 2
    for row in rows:
        assert row["engine/logprob_abs_diff"] < 1e-5, row["engine/logprob_abs_diff"]
        assert all(key in row for key in EPISODE_KEYS)
    assert any(row["episode/turns"] > 1 for row in rows)
    # first turns: the 3-token prompts (user: find c), training's as whole groups (n = G); later
    # turns: one live episode each (n = 1), its ids holding the tool's reply
    prompts = [(p, n) for batch, n in requests for p in batch]
    later = [(p, n) for p, n in prompts if len(p) > 3]
    assert any(n == 4 and len(p) == 3 for p, n in prompts) and later
    assert all(n == 1 and TOOL in p[3:] for p, n in later)
    assert all(isinstance(t, int) for prompts, _ in requests for p in prompts for t in p)


def test_async_episodes_from_a_rollout_server(tmp_path):
    """max_staleness 1 with the server: episodes sampled beside the update carry the server's version."""
    from gspo_lightning.cli import main
    from tests.helpers import serve_in_thread

    app, httpd, url = serve_in_thread("builtin:tiny-lookup", {"class_path": "gspo_lightning.rollout.HFEngine"},
                                      prompt_length=8, response_length=12)
    try:
        engine = {"class_path": "gspo_lightning.rollout.RemoteEngine", "init_args": {"urls": [url]}}
        main(["fit", "--config", str(resumable_config(tmp_path, 3, **{**ASYNC, "engine": engine}))])
    finally:
        httpd.shutdown()
        app.close()
    rows = metric_rows(tmp_path)
    assert [float(rows[v]["async/lag"]) for v in sorted(rows)] == [0.0, 1.0, 1.0]
    assert float(rows[2.0]["engine/logprob_abs_diff"]) < 1e-5  # lag 0: the server's weights are the trainer's
    assert all(key in row for row in rows.values() for key in EPISODE_KEYS)


# -- 4. dynamic sampling ----------------------------------------------------------------------------
def episode_rollout(script, rewards, tag):
    """A rollout of two lookup episodes (one group) from scripted turns, as the worker builds it."""
    from gspo_lightning.models.tiny import build_tokenizer, get_spec
    from gspo_lightning.episodes.multi_turn import MultiTurn
    from gspo_lightning.rollout.episodes import run_episodes
    from gspo_lightning.rollout.engine import SamplingParams
    from gspo_lightning.rollout.worker import Rollout, build_rollout_tensors
    from tests.helpers_episodes import ROW

    tokenizer = build_tokenizer(get_spec("tiny-lookup"))
    episodes = MultiTurn(LookupEnvironment(), end_of_turn="")
    episodes.start(tokenizer)
    batch = run_episodes(episodes, ScriptedEngine(script), [ROW["prompt"]], [ROW], 2, SamplingParams(max_new_tokens=12), seed=0)
    tensors = build_rollout_tensors(batch.prompt_ids, batch.generation, 1, tokenizer.pad_token_id, torch.device("cpu"),
                                    loss_mask=batch.loss_mask)
    return Rollout(**tensors, rewards=torch.tensor(rewards), reward_components={"r": torch.tensor(rewards)}, group_size=2,
                   policy_version=0, prompts=[tag] * 2, completions=[f"{tag}{i}" for i in range(2)],
                   turn_of_token=batch.turn_of_token, turn_rewards=batch.turn_rewards, episode_stats=batch.stats)


def test_select_groups_keeps_environment_tokens_attended_and_out_of_the_response_mask():
    from gspo_lightning.rollout.dynamic_sampling import select_groups
    from tests.helpers_episodes import (
        ANSWER,
        CALL,
        DIGIT,
        EOS,
        GET,
        GUESS,
        KEY,
        PAD,
        TOOL,
    )

    single = episode_rollout([[GUESS, GUESS]], [0.0, 0.0], "s")  # one turn each: 2 tokens wide
    multi = episode_rollout([[CALL, GUESS], [ANSWER]], [1.0, 0.0], "m")  # call, reply, answer: 7 wide
    merged = select_groups([single, multi], [(1, 0), (0, 0)], PAD)
    p = merged.prompt_width
    episode = [GET, KEY["c"], EOS, TOOL, DIGIT[3], DIGIT[3], EOS]
    assert merged.input_ids[0, p:].tolist() == episode
    # the tool's reply (positions 3..4) is attended to but trains nothing
    assert merged.attention_mask[0, p:].tolist() == [1] * 7
    assert merged.response_mask[0].tolist() == [True, True, True, False, False, True, True]
    assert merged.turn_of_token[0].tolist() == [0, 0, 0, -1, -1, 1, 1]
    assert merged.engine_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, 0, 0, -0.4, -0.5])
    # the narrower round is padded: neither attended nor trained, turn -1
    assert merged.attention_mask[2, p:].tolist() == [1, 1] + [0] * 5
    assert merged.response_mask[2].tolist() == [True, True] + [False] * 5
    assert merged.turn_of_token[2].tolist() == [0, 0] + [-1] * 5
    assert merged.turn_rewards == [[0.0, 0.0], [0.0], [0.0], [0.0]]
    assert merged.lengths.tolist() == [5, 2, 2, 2]  # the model's own tokens
    assert merged.episode_stats["episode/turns"] == pytest.approx((1.5 + 1.0) / 2)  # each round's mean, averaged


def test_the_environment_token_fraction_is_the_kept_rows_tokens():
    """Logged from the step's masks, weighted by tokens: what a step trains on, the same over ranks."""
    from gspo_lightning.rollout.dynamic_sampling import select_groups
    from gspo_lightning.training.metrics import StepMetrics, record_rollout
    from tests.helpers_episodes import ANSWER, CALL, GUESS, PAD

    single = episode_rollout([[GUESS, GUESS]], [0.0, 0.0], "s")
    multi = episode_rollout([[CALL, GUESS], [ANSWER]], [1.0, 0.0], "m")
    merged = select_groups([single, multi], [(1, 0), (0, 0)], PAD)
    metrics = StepMetrics()
    record_rollout(metrics, merged, torch.zeros_like(merged.engine_logprobs))
    values = metrics.compute()
    assert values["episode/environment_token_frac"] == pytest.approx(2 / (7 + 2 + 2 + 2))  # one 2-token reply
    assert values["episode/turns"] == pytest.approx(1.25)


def test_ranks_of_a_sharded_policy_take_every_turn_together():
    """With a lockstep (a sharded policy sampled in place) a rank whose episodes ended samples a
    stand-in turn while another rank goes on, and every turn asks for the whole budget; the
    episodes are the ones the free loop makes (tests/test_distributed.py runs it on 2 ranks)."""
    from gspo_lightning.models.tiny import build_tokenizer, get_spec
    from gspo_lightning.episodes.multi_turn import MultiTurn
    from gspo_lightning.rollout.episodes import run_episodes
    from gspo_lightning.rollout.engine import SamplingParams
    from tests.helpers_episodes import CALL, GUESS, ROW

    tokenizer = build_tokenizer(get_spec("tiny-lookup"))
    params = SamplingParams(max_new_tokens=12)
    free = MultiTurn(LookupEnvironment(), end_of_turn="")
    free.start(tokenizer)
    alone = run_episodes(free, ScriptedEngine([[GUESS, GUESS]]), ["find c"], [ROW], 2, params, seed=0)

    asked = []
    episodes = MultiTurn(LookupEnvironment(), end_of_turn="", max_turns=3)
    episodes.start(tokenizer, lockstep=lambda done: asked.append(done) or len(asked) == 3)  # the other rank: 2 turns
    engine = ScriptedEngine([[GUESS, GUESS], [CALL]])
    batch = run_episodes(episodes, engine, ["find c"], [ROW], 2, params, seed=0)
    assert asked == [False, True, True]  # live at turn 1, done here at turns 2 and 3
    assert len(engine.calls) == 2 and engine.calls[1]["n"] == 1 and engine.calls[1]["max_new_tokens"] == 12
    assert torch.equal(batch.generation.completion_ids, alone.generation.completion_ids)
    assert torch.equal(batch.loss_mask, alone.loss_mask) and batch.stats == alone.stats


def test_dynamic_sampling_with_episodes_runs_and_logs_episode_metrics(tmp_path):
    from gspo_lightning.cli import main

    config = episodes_config(tmp_path, dynamic_sampling=True, max_sampling_rounds=2, old_logprobs="engine")
    main(["fit", "--config", str(config), "--seed_everything", "7"])
    rows = logged(tmp_path)
    assert len(rows) == 2
    for row in rows:
        # a kept episode from another round keeps its own masks: the engine's tokens score alike
        assert row["engine/logprob_abs_diff"] < 1e-5, row["engine/logprob_abs_diff"]
        assert all(key in row for key in EPISODE_KEYS) and "dynamic_sampling/rounds" in row
    assert any(row["dynamic_sampling/rounds"] > 1 for row in rows)

"""Asynchronous GSPO: the rollout pipeline's schedule, staleness window and checkpoints
(``rollout/pipeline.py``), the module's checks, and exact resume of an async run."""

import threading
from pathlib import Path

import pytest
import torch
import yaml

from gspo_lightning.rollout.pipeline import RolloutPipeline, rollout_from_dict, rollout_to_dict
from gspo_lightning.rollout.worker import Rollout


class FakeProducer:
    """Stands for the worker: the 'engine' holds a weights step; a rollout records which."""

    def __init__(self):
        self.weights_step = 0
        self.calls = []
        self.threads = set()

    def push(self, step):
        """The weights capture of ``step``: the returned push makes them reach the engine
        (the pipeline runs it on the producer, before the next generation)."""
        def push():
            self.weights_step = step
            self.threads.add(threading.current_thread().name)
            return {"time/weight_sync": 0.0}
        return lambda: (push, {"time/weight_capture": 0.0})

    def generate(self, batch, step):
        self.calls.append((step, self.weights_step))
        self.threads.add(threading.current_thread().name)
        n = len(batch["prompt_ids"])
        return Rollout(
            input_ids=torch.zeros(n, 2, dtype=torch.long), attention_mask=torch.ones(n, 2, dtype=torch.long), prompt_width=1,
            response_mask=torch.ones(n, 1, dtype=torch.bool), engine_logprobs=torch.zeros(n, 1), rewards=torch.zeros(n),
            reward_components={"r": torch.zeros(n)}, truncated=torch.zeros(n, dtype=torch.bool), group_size=1,
            policy_version=self.weights_step, prompts=["p"] * n, completions=["c"] * n,
        )


def batch_at(step):
    return {"prompt_ids": [[step, 1], [step, 2]]}


def run(pipeline, producer, steps, start=0):
    lags = []
    for step in range(start, steps):
        rollout, stats = pipeline.next(step, batch_at(step), producer.push(step))
        assert rollout.policy_version == step - stats["async/lag"]
        lags.append(stats["async/lag"])
    return lags


@pytest.mark.parametrize("k", [1, 2])
def test_each_step_trains_on_the_rollout_sampled_k_steps_before(k):
    producer = FakeProducer()
    pipeline = RolloutPipeline(producer.generate, batch_at, max_staleness=k)
    lags = run(pipeline, producer, 6)
    pipeline.close()
    # first steps: everything up to step k is sampled with the first weights
    assert lags == [min(step, k) for step in range(6)]
    # every batch once, in order; batch s + k sampled at step s
    assert [step for step, _ in producer.calls] == list(range(6 + k))
    assert producer.calls[k + 2] == (k + 2, 2)
    assert all(name.startswith("rollout-producer") for name in producer.threads)


def test_the_weight_push_runs_on_the_producer_while_the_step_trains():
    """The step's path holds only the capture; the push waits in the producer's queue, runs
    before the generation it precedes, and never while a generation reads the weights."""
    events = []
    started = threading.Event()
    release = threading.Event()

    def generate(batch, step):
        events.append(("generate", step))
        if step == 1:  # batch 1 is still generating when step 0 trains
            started.set()
            assert release.wait(5)
        return FakeProducer().generate(batch, step)

    def capture(step):
        def push():
            events.append(("push", step, threading.current_thread().name))
            return {"time/weight_sync": 0.5}
        def captured():
            events.append(("capture", step, threading.current_thread().name))
            return push, {"time/weight_capture": 0.01}
        return captured

    pipeline = RolloutPipeline(generate, batch_at, max_staleness=1)
    rollout, stats = pipeline.next(0, batch_at(0), capture(0))
    assert started.wait(5)
    # step 0 trains now; batch 1 generates beside it; the push of step 1 must wait for it
    assert stats["time/weight_capture"] == 0.01 and "time/weight_sync" not in stats
    assert rollout.timings["time/weight_sync"] == 0.5  # the push that preceded this rollout
    release.set()
    pipeline.next(1, batch_at(1), capture(1))
    pipeline.drain()
    pipeline.close()
    main = threading.current_thread().name
    assert [e[0] for e in events] == ["capture", "push", "generate", "generate", "capture", "push", "generate"]
    assert [e[1] for e in events] == [0, 0, 0, 1, 1, 1, 2]
    assert all(e[2] == main for e in events if e[0] == "capture")
    assert all(e[2].startswith("rollout-producer") for e in events if e[0] == "push")


def test_the_lag_counts_the_version_the_engine_reports():
    """k = 1, versions 10 x the step. From step 2 on the engine stops taking weights and keeps
    reporting version 10 (step 1's): step 2's rollout, scheduled at step 1, is fine (lag 1);
    step 3's, scheduled at step 2, was sampled with step 1's weights: lag 2, out of the window,
    sampled again (by this engine, again with version 10: reweighting is then the only way)."""
    producer = FakeProducer()
    frozen = {"from": 2}

    def push(step):
        def captured():
            def sent():
                if step < frozen["from"]:
                    producer.weights_step = 10 * step
                return {}
            return sent, {}
        return captured

    pipeline = RolloutPipeline(producer.generate, batch_at, max_staleness=1, stale_rollouts="reweight")
    lags = []
    for step in range(4):
        rollout, stats = pipeline.next(step, batch_at(step), push(step), version=10 * step)
        lags.append((stats["async/lag"], stats["async/out_of_window"]))
    pipeline.close()
    assert lags == [(0.0, 0.0), (1.0, 0.0), (1.0, 0.0), (2.0, 1.0)]
    state = pipeline.state_dict()
    assert state["step_versions"] == [[0, 0], [1, 10], [2, 20], [3, 30]]  # kept for the resumed run


def test_a_rollout_for_other_prompts_is_refused():
    producer = FakeProducer()
    pipeline = RolloutPipeline(producer.generate, batch_at, max_staleness=1)
    pipeline.next(0, batch_at(0), producer.push(0))
    with pytest.raises(RuntimeError, match="out of step"):
        pipeline.next(1, batch_at(7), producer.push(1))
    pipeline.close()


@pytest.mark.parametrize("policy", ["regenerate", "reweight"])
def test_checkpoint_round_trip_and_the_window_after_a_smaller_k(policy):
    producer = FakeProducer()
    pipeline = RolloutPipeline(producer.generate, batch_at, max_staleness=2)
    run(pipeline, producer, 3)
    state = pipeline.state_dict()  # steps 3 and 4 are queued, sampled at steps 1 and 2
    pipeline.close()
    assert [(p["index"], p["sampled_at"]) for p in state["pending"]] == [(3, 1), (4, 2)]

    # resumed with k = 1: step 3's rollout (lag 2) is out of the window
    producer.calls.clear()
    resumed = RolloutPipeline(producer.generate, batch_at, max_staleness=1, stale_rollouts=policy)
    resumed.load_state_dict(state, torch.device("cpu"))
    rollout, stats = resumed.next(3, batch_at(3), producer.push(3))
    assert stats["async/out_of_window"] == 1.0
    if policy == "regenerate":
        assert stats["async/regenerated"] == 1.0 and rollout.policy_version == 3 and stats["async/lag"] == 0.0
        assert producer.calls[-1] == (3, 3)  # sampled again with the weights of step 3
    else:
        assert stats["async/regenerated"] == 0.0 and rollout.policy_version == 1 and stats["async/lag"] == 2.0
    rollout, stats = resumed.next(4, batch_at(4), producer.push(4))  # sampled at 2, lag 2 again
    assert stats["async/out_of_window"] == 1.0
    resumed.close()


def test_a_failed_generation_is_left_out_of_the_checkpoint_and_raised_by_its_own_step():
    producer = FakeProducer()

    def generate(batch, step):
        if step == 2:
            raise RuntimeError("the grader is down")
        return producer.generate(batch, step)

    pipeline = RolloutPipeline(generate, batch_at, max_staleness=2)
    pipeline.next(0, batch_at(0), producer.push(0))  # submits 0, 1, 2
    state = pipeline.state_dict()  # the checkpoint written as the run stops: no exception here
    assert [p["index"] for p in state["pending"]] == [1]
    pipeline.next(1, batch_at(1), producer.push(1))  # batch 1 finished before the failure: trained
    with pytest.raises(RuntimeError, match="the grader is down"):
        pipeline.next(2, batch_at(2), producer.push(2))
    pipeline.close()


def test_a_failure_ahead_loses_no_finished_batch_and_stops_the_producer_at_once():
    """k = 2: batch 3 fails on the producer while step 1 trains. Step 2 still trains on batch
    2 (finished before the failure), batch 4 is not generated (the engine is not called
    again), step 3 raises batch 3's error, and the checkpoint then holds no failed batch."""
    producer = FakeProducer()

    def generate(batch, step):
        if step == 3:
            raise RuntimeError("the rollout server is gone")
        return producer.generate(batch, step)

    pipeline = RolloutPipeline(generate, batch_at, max_staleness=2)
    run(pipeline, producer, 2)  # steps 0 and 1: batches 0 .. 3 submitted, batch 3 fails
    rollout, stats = pipeline.next(2, batch_at(2), producer.push(2))  # batch 2 was finished: trained
    assert rollout.input_ids.shape[0] == 2 and stats["async/lag"] == 2.0
    with pytest.raises(RuntimeError, match="the rollout server is gone"):
        pipeline.next(3, batch_at(3), producer.push(3))
    assert [step for step, _ in producer.calls] == [0, 1, 2]  # batch 4 was never generated
    assert pipeline.state_dict()["pending"] == []  # 4 failed at once ("not generated"): sampled again on resume
    pipeline.close()


def test_a_failure_on_another_rank_stops_this_rank_on_the_same_step_with_the_same_error_class():
    from gspo_lightning.rewards.base import RewardError

    producer = FakeProducer()
    calls = []

    def gather(value):  # rank 1's rollout of batch 1 failed; this is rank 0
        calls.append(value)
        return [value, ((RewardError, "the grader is down"), 0)] if len(calls) == 2 else [value, (None, 0)]

    pipeline = RolloutPipeline(producer.generate, batch_at, max_staleness=1, gather=gather)
    pipeline.next(0, batch_at(0), producer.push(0))
    with pytest.raises(RewardError, match="prompt batch 1 failed on rank 1: the grader is down"):
        pipeline.next(1, batch_at(1), producer.push(1))
    assert calls == [(None, 0), (None, 1)]  # this rank's own rollouts were fine (lags 0 and 1)
    pipeline.close()


def test_the_ranks_decide_the_window_on_the_largest_lag():
    """Rank 1's engine reported older weights (lag 2 > k = 1): this rank, whose rollout is in
    the window, must regenerate too, or the ranks would part ways (one generating, one not)."""
    producer = FakeProducer()
    pipeline = RolloutPipeline(producer.generate, batch_at, max_staleness=1,
                               gather=lambda value: [value, (None, 2 if value[1] == 1 else value[1])])
    pipeline.next(0, batch_at(0), producer.push(0))
    rollout, stats = pipeline.next(1, batch_at(1), producer.push(1))
    pipeline.close()
    assert stats["async/out_of_window"] == 1.0 and stats["async/regenerated"] == 1.0
    assert producer.calls[-1] == (1, 1)  # sampled again with the weights of step 1


def test_rollout_serialization_round_trip():
    producer = FakeProducer()
    rollout = producer.generate(batch_at(0), 0)
    rollout.behaviour_trainer_logprobs = torch.tensor([[0.5], [0.25]])
    again = rollout_from_dict(rollout_to_dict(rollout), torch.device("cpu"))
    for name in ("input_ids", "engine_logprobs", "behaviour_trainer_logprobs"):
        assert torch.equal(getattr(again, name), getattr(rollout, name))
    assert again.reward_components.keys() == rollout.reward_components.keys() and again.prompts == rollout.prompts


def test_bad_staleness_settings_are_one_clear_line(tmp_path):
    from tests.helpers_fit import fit, make_module

    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        make_module(max_staleness=-1)
    with pytest.raises(ValueError, match="stale_rollouts=reweight .* set off_policy"):
        make_module(max_staleness=1, stale_rollouts="reweight")
    with pytest.raises(ValueError, match=r"dynamic_sampling .* \(max_staleness > 0\) cannot: turn one of them off"):
        make_module(max_staleness=1, dynamic_sampling=True)
    from gspo_lightning.objective.offpolicy import OffPolicyCorrection

    with pytest.raises(ValueError, match="off_policy.mode=bypass .* set old_logprobs=engine"):
        make_module(off_policy=OffPolicyCorrection(mode="bypass"))
    with pytest.raises(ValueError, match="HFEngine samples from the policy's own weights"):
        fit(make_module(max_staleness=1), tmp_path, max_steps=1)


def test_stale_rollouts_trained_as_on_policy_are_warned_once_at_start():
    import warnings

    from gspo_lightning.objective.offpolicy import OffPolicyCorrection
    from gspo_lightning.rollout import HFCopyEngine
    from tests.helpers_fit import make_module

    with pytest.warns(UserWarning, match="trained as if the current policy had sampled them") as caught:
        make_module(max_staleness=2, engine=HFCopyEngine(dtype="float32"))
    assert sum("trained as if" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a correction, or the engine's log-probs as the old policy: no warning
        make_module(max_staleness=2, engine=HFCopyEngine(dtype="float32"), off_policy=OffPolicyCorrection(mode="decoupled"))
        make_module(max_staleness=2, engine=HFCopyEngine(dtype="float32"), old_logprobs="engine")
        make_module(engine=HFCopyEngine(dtype="float32"))


ROOT = Path(__file__).resolve().parents[1]


def async_config(folder: Path, max_steps: int, max_staleness: int) -> Path:
    from tests.helpers_fit import write_config

    path = write_config(folder, max_steps)
    config = yaml.safe_load(path.read_text())
    config["model"].update({
        "max_staleness": max_staleness,
        "engine": {"class_path": "gspo_lightning.rollout.HFCopyEngine", "init_args": {"dtype": "float32"}},
        "off_policy": {"mode": "decoupled", "level": "seq", "method": "truncate"},
        "clip_budget": True,
    })
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_async_stop_and_resume_matches_the_straight_run_bit_for_bit(tmp_path):
    from gspo_lightning.cli import main
    from tests.helpers_fit import metric_rows, policy_state

    straight = tmp_path / "straight"
    main(["fit", "--config", str(async_config(straight, 5, 2))])
    resumed = tmp_path / "resumed"
    main(["fit", "--config", str(async_config(resumed, 2, 2))])
    saved = torch.load(resumed / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    assert [(p["index"], p["sampled_at"]) for p in saved["gspo"]["ranks"][0]["pending_rollouts"]["pending"]] == [(2, 0), (3, 1)]
    main(["fit", "--config", str(async_config(resumed, 5, 2)), "--ckpt_path", str(resumed / "ckpt" / "last.ckpt")])

    a, b = policy_state(straight / "ckpt" / "last.ckpt"), policy_state(resumed / "ckpt" / "last.ckpt")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows_a, rows_b = metric_rows(straight), metric_rows(resumed)
    assert sorted(rows_a) == sorted(rows_b) == [2.0, 4.0, 6.0, 8.0, 10.0]
    for version in rows_a:
        assert rows_a[version] == rows_b[version], version
    # the lag in rollout steps: 0, 1, then k = 2; the correction and the clip budget are logged
    assert [float(rows_a[v]["async/lag"]) for v in sorted(rows_a)] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert all("off_policy/ess" in row and "clip_budget/staleness" in row for row in rows_a.values())


@pytest.mark.slow
def test_a_failing_reward_on_the_producer_stops_the_run_with_a_checkpoint_and_it_resumes(tmp_path):
    from gspo_lightning.rewards import RewardSpec
    from gspo_lightning.rewards.base import RewardError
    from gspo_lightning.rollout import HFCopyEngine
    from tests.helpers_fit import CALLS, fit, make_module

    CALLS["n"] = 0
    reward = [RewardSpec(function="tests.helpers_fit.reward_that_fails_on_the_third_call")]

    def module():
        return make_module(rewards=reward, num_mini_batches=2, max_staleness=1, engine=HFCopyEngine(dtype="float32"))

    with pytest.raises(RewardError, match="the grader is down"):
        fit(module(), tmp_path, max_steps=5, enable_checkpointing=True)
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    # batch 2 was generated (and failed) on the producer during step 1; step 2 raised it; the
    # resumed run goes on with batch 3, as the synchronous loop does after a failed step
    assert saved["global_step"] == 2 and saved["gspo"]["ranks"][0]["pending_rollouts"]["pending"] == []
    again = module()
    fit(again, tmp_path / "resumed", max_steps=4, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert again.policy_version == 8

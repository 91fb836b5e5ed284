"""Where a step's rollout comes from (``rollout/source.py``), without a Trainer: the
synchronous source pushes the step's weights and refuses a stale rollout, the pipelined
one trains on rollouts sampled ahead and reports their lag, and ``max_staleness`` picks one."""

import threading
from types import SimpleNamespace

import pytest
import torch

from gspo_lightning.rollout.source import PipelinedRollouts, SynchronousRollouts, rollout_source
from gspo_lightning.rollout.worker import Rollout


class FakeWorker:
    """Stands for RolloutWorker: the 'engine' holds a weights version; a rollout is tagged
    with it (plus ``lag``, an engine that reports older weights) and records its seed."""

    def __init__(self, dtype="float32", lag=0):
        self.engine = SimpleNamespace(shares_policy_weights=False, dtype=dtype, weight_quantization=None, model="copy")
        self.version, self.lag = -1, lag
        self.pushes, self.seeds, self.threads = [], [], set()

    def sync_weights(self, version, weights):
        if version == self.version:
            return {}
        self.pushes.append((version, dict(weights())))
        self.version = version
        return {"time/weight_sync": 0.5}

    def capture_weights(self, version, weights):
        if version == self.version:
            return None, {}
        copy = dict(weights())

        def push():
            self.pushes.append((version, copy))
            self.version = version
            return {}
        return push, {"time/weight_capture": 0.0}

    def rollout(self, batch, *, seed, device, evaluation=False):
        self.seeds.append(seed)
        self.threads.add(threading.current_thread().name)
        n = len(batch["prompt_ids"])
        return Rollout(
            input_ids=torch.zeros(n, 2, dtype=torch.long), attention_mask=torch.ones(n, 2, dtype=torch.long), prompt_width=1,
            response_mask=torch.ones(n, 1, dtype=torch.bool), engine_logprobs=torch.zeros(n, 1), rewards=torch.zeros(n),
            reward_components={}, truncated=torch.zeros(n, dtype=torch.bool), group_size=1,
            policy_version=self.version - self.lag, prompts=["p"] * n, completions=["c"] * n, timings={},
        )


def batch_at(index):
    return {"prompt_ids": [[index, 1], [index, 2]], "index": index}


def weights_of(state):
    return lambda: iter([("w", torch.tensor(float(state["version"])))])


def test_the_synchronous_source_pushes_the_steps_weights_and_samples_with_its_seed():
    worker, state = FakeWorker(), {"version": 0}
    source = SynchronousRollouts(worker, weights_of(state), torch.device("cpu"), seed=lambda step: 100 + step)
    for step, version in [(0, 0), (1, 4), (2, 8)]:
        state["version"] = version
        rollout, stats = source.next(step, batch_at(step), version)
        assert rollout.policy_version == version and stats == {}
        assert rollout.timings == {"time/weight_sync": 0.5}  # the push's time is the step's
    assert [(v, float(w["w"])) for v, w in worker.pushes] == [(0, 0.0), (4, 4.0), (8, 8.0)]
    assert worker.seeds == [100, 101, 102]
    assert source.state_dict() is None  # nothing generated ahead, nothing to checkpoint


def test_an_async_checkpoint_resumed_synchronously_says_its_rollouts_are_sampled_again():
    source = SynchronousRollouts(FakeWorker(), weights_of({"version": 6}), torch.device("cpu"), seed=lambda s: s)
    with pytest.warns(UserWarning, match=r"2 rollout\(s\) generated ahead \(prompt batches \[3, 4\]\).*sampled again"):
        source.load_state_dict({"pending": [{"index": 3}, {"index": 4}]}, torch.device("cpu"))
    rollout, _ = source.next(3, batch_at(3), 6)  # batch 3 itself, with the current weights
    assert rollout.policy_version == 6
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        source.load_state_dict({"pending": []}, torch.device("cpu"))  # nothing generated ahead: nothing to say


def test_the_synchronous_source_refuses_a_rollout_of_other_weights():
    source = SynchronousRollouts(FakeWorker(lag=1), weights_of({"version": 3}), torch.device("cpu"), seed=lambda s: s)
    with pytest.raises(RuntimeError, match="stale rollout: sampled with policy version 2, the policy is at 3"):
        source.next(0, batch_at(0), 3)


def test_the_pipelined_source_trains_on_rollouts_sampled_one_step_ahead():
    """k = 1, 4 optimizer steps per rollout step: step t trains on the rollout sampled with
    the weights of step t - 1 (version 4 (t - 1)), on the producer thread."""
    worker, state = FakeWorker(), {"version": 0}
    source = PipelinedRollouts(worker, weights_of(state), torch.device("cpu"), seed=lambda step: 100 + step,
                               batch_at=batch_at, max_staleness=1)
    lags = []
    for step in range(4):
        state["version"] = 4 * step
        rollout, stats = source.next(step, batch_at(step), 4 * step)
        assert rollout.prompts == ["p", "p"]
        lags.append((stats["async/lag"], stats["async/lag_versions"]))
    source.close()
    assert lags == [(0.0, 0.0), (1.0, 4.0), (1.0, 4.0), (1.0, 4.0)]
    assert worker.seeds == [100, 101, 102, 103, 104]  # every batch sampled once, with its own step's seed
    assert worker.threads == {"rollout-producer_0"}


@pytest.mark.parametrize("dtype, taken", [("float32", True), ("bfloat16", False)])
def test_behaviour_logprobs_are_taken_only_from_an_exact_float32_copy(dtype, taken):
    worker, state = FakeWorker(dtype=dtype), {"version": 0}
    seen = []

    def behaviour_logprobs(model, rollout):
        seen.append(model)
        return torch.full_like(rollout.engine_logprobs, -1.0)

    source = PipelinedRollouts(worker, weights_of(state), torch.device("cpu"), seed=lambda s: s, batch_at=batch_at,
                               max_staleness=1, behaviour_logprobs=behaviour_logprobs)
    rollout, _ = source.next(0, batch_at(0), 0)
    source.close()
    assert (rollout.behaviour_trainer_logprobs is not None) == taken
    assert seen == (["copy", "copy"] if taken else [])  # batches 0 and 1, under the engine's own model


def test_max_staleness_picks_the_source_and_refuses_what_cannot_run_apart():
    cpu, weights, seed = torch.device("cpu"), weights_of({"version": 0}), lambda s: s
    assert type(rollout_source(FakeWorker(), weights, cpu, seed)) is SynchronousRollouts
    data = SimpleNamespace(train_batch=batch_at)
    source = rollout_source(FakeWorker(), weights, cpu, seed, max_staleness=2, datamodule=data)
    assert type(source) is PipelinedRollouts and source.pipeline.max_staleness == 2
    shared = FakeWorker()
    shared.engine.shares_policy_weights = True
    with pytest.raises(ValueError, match="max_staleness=1 generates while the policy trains"):
        rollout_source(shared, weights, cpu, seed, max_staleness=1, datamodule=data)
    with pytest.raises(ValueError, match="the data module's train_batch"):
        rollout_source(FakeWorker(), weights, cpu, seed, max_staleness=1, datamodule=object())

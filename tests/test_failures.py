"""Failures in a step's rollout (an environment, an engine) keep the run up to the last finished
step: `last.ckpt` and one line naming the cause and the resume command; the run then resumes to
its end."""

from __future__ import annotations

import pytest

from tests.helpers_episodes import lookup_config


def _fit(config, *extra):
    from gspo_lightning.cli import main

    main(["fit", "--config", str(config), *extra])


@pytest.mark.parametrize("model, cause", [
    ({"episodes": {"environment": {"class_path": "tests.helpers_episodes.FailsOnceEnvironment"}, "max_turns": 3,
                   "max_turn_tokens": 3, "end_of_turn": ""}}, "EpisodeError: the environment FailsOnceEnvironment raised"),
    ({"episodes": {"environment": {"class_path": "tests.helpers_episodes.ResetFailsOnceEnvironment"}, "max_turns": 3,
                   "max_turn_tokens": 3, "end_of_turn": ""}}, "ConnectionError: the environment server refused the session"),
    ({"engine": {"class_path": "tests.helpers_episodes.FailsOnceEngine"}}, "RuntimeError: CUDA error"),
])
def test_a_rollout_that_fails_keeps_the_finished_steps_and_resumes(tmp_path, capsys, model, cause):
    config = lookup_config(tmp_path, **model)
    with pytest.raises(BaseException):  # SystemExit for our own errors, the error itself for anything else
        _fit(config, "--trainer.max_steps=3")
    printed = capsys.readouterr()
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    line = next(line for line in printed.out.splitlines() if line.startswith("the run stopped at step 2"))
    assert cause in line and "the run up to step 1 is saved in" in line and f"--ckpt_path {checkpoint}" in line
    import torch

    assert torch.load(checkpoint, weights_only=True)["global_step"] == 1
    _fit(config, "--trainer.max_steps=3", f"--ckpt_path={checkpoint}")
    assert torch.load(checkpoint, weights_only=True)["global_step"] == 3

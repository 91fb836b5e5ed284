"""A verifiers (v1) environment whose only reward raises: tests/test_verifiers_envs.py."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def broken(self, trace: vf.Trace) -> float:
        raise ValueError("broken on purpose")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> list[BrokenTask]:
        return [BrokenTask(vf.TaskData(id="next-2", prompt="next 2"), self.config.task)]


__all__ = ["BrokenTaskset"]

"""successor_v1: the quickstart's successor task as a verifiers (v1) environment, in the shape
verifiers documents (``vf-init``): a ``TaskData`` subclass, a ``Task`` with ``@vf.reward``
methods, a ``TasksetConfig`` and a ``Taskset`` exported in ``__all__``. Nothing in it knows
gspo-lightning: configs/verifiers_successor.yaml trains on it unchanged.

Prompt ``next 2``; the answer is the next digit four times (``3 3 3 3``). Two rewards, as
verifiers sums them: ``successor`` (weight 1) is the share of the reply's first four words that
are the next digit; ``short`` (weight 0.1) asks for at most four words.
"""

import verifiers.v1 as vf

REPEATS = 4


class SuccessorData(vf.TaskData):
    target: str


class SuccessorTask(vf.Task[SuccessorData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def successor(self, trace: vf.Trace) -> float:
        words = (trace.last_reply or "").split()[:REPEATS]
        return sum(word == self.data.target for word in words) / REPEATS

    @vf.reward(weight=0.1)
    async def short(self, trace: vf.Trace) -> float:
        return 1.0 if 0 < len((trace.last_reply or "").split()) <= REPEATS else 0.0


class SuccessorConfig(vf.TasksetConfig):
    digits: list[int] = list(range(10))
    """The prompts' digits, each ``copies`` times."""
    copies: int = 1


class SuccessorTaskset(vf.Taskset[SuccessorTask, SuccessorConfig]):
    def load(self) -> list[SuccessorTask]:
        digits = [d for d in self.config.digits for _ in range(self.config.copies)]
        return [SuccessorTask(SuccessorData(id=f"next-{d}-{i}", prompt=f"next {d}", target=str((d + 1) % 10)),
                              self.config.task)
                for i, d in enumerate(digits)]


__all__ = ["SuccessorTaskset"]

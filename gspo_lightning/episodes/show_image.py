"""An environment that shows the model an image: the row's picture, after the model's first turn.

The smallest environment whose reply is an image (vision-language episodes, docs/vlm.md): the
model's first turn gets back a user message with the row's image and a question; its second turn
is its answer, rewarded 1 when its first word is the row's answer (a turn reward).

.. code-block:: yaml

    episodes:
      environment:
        class_path: gspo_lightning.episodes.ShowImageEnvironment
        init_args: {image_column: picture, answer_column: target, question: colour}
"""

from __future__ import annotations

from gspo_lightning.episodes.environments import Environment
from gspo_lightning.episodes.messages import StepResult


class ShowImageEnvironment(Environment):
    """Shows the image in the row's ``image_column`` (a PIL image, bytes or a path) with the text
    ``question`` after the model's first turn; rewards the second turn 1 when its first word is the
    row's ``answer_column``, else 0, and ends the episode."""

    blocking = False  # nothing here waits
    scores_episodes = True  # its turn reward can be an episode's only reward

    def __init__(self, image_column: str = "picture", answer_column: str = "target", question: str = "colour"):
        self.image_column, self.answer_column, self.question = image_column, answer_column, question

    def reset(self, row: dict, prompt: list[dict]) -> list[dict]:
        self.picture, self.answer, self.shown = row[self.image_column], str(row[self.answer_column]), False
        return list(prompt)

    def step(self, assistant_message: dict) -> StepResult:
        if not self.shown:
            self.shown = True
            content = [{"type": "image", "image": self.picture}, {"type": "text", "text": self.question}]
            return StepResult(messages=[{"role": "user", "content": content}])
        words = assistant_message["content"].split()
        return StepResult(messages=[], reward=float(bool(words) and words[0] == self.answer), done=True)


__all__ = ["ShowImageEnvironment"]

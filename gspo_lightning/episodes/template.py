"""Token-in, token-out: the ids of an episode are the engine's sampled ids plus the
environment's messages rendered once by the chat template, never a re-tokenized conversation.

The token-level contract, for an episode of turns ``1..T``::

    ids = prompt_ids(messages_0)                    # the first prompt, generation prompt included
        + sampled_1                                 # the engine's ids, ending with the end-of-turn token
        + continuation_ids(messages_1, new_1)       # m = 0: what the template puts after that token,
        + sampled_2                                 #   the environment's messages, the next generation prompt
        + ...

where ``messages_t`` is the conversation up to and including assistant turn ``t`` (its content
the decoded text of ``sampled_t``) and ``new_t`` the environment's messages after it. Only the
environment's text is tokenized; the model's ids are kept as sampled, because decoding and
re-encoding them can give other ids (BPE is not a bijection) and the trainer would then score
tokens that were never sampled.

The continuation is found on TEXT: render the conversation without the new messages (no
generation prompt) and with them (with the generation prompt); the second must start with the
first, and the continuation is the difference, starting right after the end-of-turn token the
model generated (so it includes the ``\\n`` ChatML writes after ``<|im_end|>``). Text, not ids,
because diffing ids would re-tokenize the assistant's turn, the very thing we avoid, and a
merge across its boundary would shift the diff. The suffix starts right after a special token,
so no merge crosses its start. So ``prompt_ids + sampled + continuation_ids`` equals tokenizing
the whole rendered conversation when the sampled ids are what the tokenizer gives their text
and no merge crosses the end of a generation prompt: the same condition as for a single-turn
prompt and its completion (a tokenizer that merges ``"\n\n"`` at the end of a text but not
before a word differs there, and then the ids the engine sampled after are the right ones).

A template that renders earlier turns differently once more messages follow (Qwen3 drops the
``<think>`` of assistant turns before the last user message, and an empty one of a turn that
is no longer last) is refused with :class:`TemplateNotAppendOnly`: the conversation the model
would see through the template is then not the one the ids hold.

Tools reach the model through the template's ``tools=`` when the template reads ``tools``;
otherwise through a system message (``system_prompt_for_tools``, ``{tools}`` replaced by the
schemas, one JSON per line), merged into the conversation's own system message if it has one.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Optional

from gspo_lightning.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_TOOLS_SYSTEM_PROMPT = (
    "You can call tools (functions) to help with the request. The tools, one JSON schema per line:\n"
    "{tools}\n"
    "To call a tool, write a JSON object with its name and arguments between <tool_call> and </tool_call>:\n"
    '<tool_call>{"name": "tool_name", "arguments": {"argument_name": "value"}}</tool_call>\n'
    "Each call's result comes back in a message from the tool."
)

# stands for an assistant turn's content while finding what the template writes after one
_SENTINEL = "\x00assistant-content\x00"


class TemplateNotAppendOnly(ValueError):
    """The chat template changes earlier turns when messages are added, or has no end-of-turn token."""


def template_reads_tools(template: str) -> bool:
    """Whether a Jinja chat template reads a ``tools`` variable (and so renders ``tools=``)."""
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)  # parsed, not run
        return "tools" in meta.find_undeclared_variables(parsed)
    except jinja2.TemplateError:  # a tag of transformers' own ({% generation %}): fall back to the name
        return re.search(r"\btools\b", template) is not None


def _common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatRenderer:
    """Renders an episode's messages with a tokenizer's chat template into token ids.

    Args:
        tokenizer: a transformers tokenizer with a ``chat_template``.
        tools_schema: the function schemas the model is shown (``Environment.tools_schema``), or None.
        system_prompt_for_tools: the system message that lists the tools when the template does not read
            ``tools``; ``{tools}`` is replaced by the schemas. None: tools are not shown that way (say, the
            dataset's prompts already show them, or carry a worked example).
        end_of_turn: the text of the token generation stops on at the end of an assistant turn; default: the
            special token the template writes right after an assistant message's content. ``""`` for a
            template that does not write the stop token (the model's end-of-sequence id stays in the ids
            as sampled, and the continuation starts with all the template writes after the content).
        template_kwargs: extra variables for the template (``{"enable_thinking": False}``).
    """

    def __init__(self, tokenizer, tools_schema: Optional[list[dict]] = None,
                 system_prompt_for_tools: Optional[str] = DEFAULT_TOOLS_SYSTEM_PROMPT,
                 end_of_turn: Optional[str] = None, template_kwargs: Optional[dict[str, Any]] = None):
        self.tokenizer = tokenizer
        self._warned_unknown = False
        self.tools_schema = tools_schema or None
        self.system_prompt_for_tools = system_prompt_for_tools
        self.template_kwargs = dict(template_kwargs or {})
        self.template = self._template_text()
        self.template_reads_tools = template_reads_tools(self.template)
        self.assistant_close = self._assistant_close()
        self.end_of_turn = end_of_turn if end_of_turn is not None else self._end_of_turn()
        if not self.assistant_close.startswith(self.end_of_turn):
            raise TemplateNotAppendOnly(f"the chat template closes an assistant turn with {self.assistant_close!r}, which "
                                        f"does not start with the end-of-turn token {self.end_of_turn!r}; set "
                                        "model.episodes.end_of_turn to the text the template writes right after an "
                                        "assistant message (\"\" when it writes none)")
        # what the template writes after the end-of-turn token ("\n" for ChatML): the continuation's first text
        self.after_end_of_turn = self.assistant_close[len(self.end_of_turn):]
        # a word-level tokenizer joins tokens with single spaces: its round trips are compared word by word
        probe = self.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
        self.keeps_whitespace = self.tokenizer.decode(self._encode(probe), skip_special_tokens=False,
                                                      clean_up_tokenization_spaces=False) == probe

    @property
    def end_of_turn_id(self) -> int:
        """The id of the end-of-turn token: the engine stops an assistant turn on it, and a turn that does not
        end with it (cut by the token budget) cannot be continued."""
        ids = self._encode(self.end_of_turn)
        if len(ids) != 1:
            raise ConfigError(f"model.episodes.end_of_turn={self.end_of_turn!r} is {len(ids)} tokens, not one special "
                              "token: set it to the text of the token generation stops on")
        return ids[0]

    def _template_text(self) -> str:
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # named templates: the tool-use one when there are tools
            template = template.get("tool_use" if self.tools_schema else "default") or template.get("default")
        if not template:
            raise ConfigError(f"the tokenizer {getattr(self.tokenizer, 'name_or_path', '')!r} has no chat template; "
                             "multi-turn episodes need one (set tokenizer.chat_template)")
        return template

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The conversation as the template writes it, tools shown as configured."""
        kwargs = dict(self.template_kwargs)
        if self.tools_schema and self.template_reads_tools:
            kwargs["tools"] = self.tools_schema
        return self.tokenizer.apply_chat_template(self._with_tools_system_message(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  chat_template=self.template, **kwargs)

    def _with_tools_system_message(self, messages: list[dict]) -> list[dict]:
        if not self.tools_schema or self.template_reads_tools or self.system_prompt_for_tools is None:
            return list(messages)
        text = self.system_prompt_for_tools.replace("{tools}", "\n".join(json.dumps(s) for s in self.tools_schema))
        if messages and messages[0].get("role") == "system":
            return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def _encode(self, text: str) -> list[int]:
        # the template writes the special tokens (a BOS included) itself
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _assistant_close(self) -> str:
        text = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}],
                           add_generation_prompt=False)
        position = text.rfind(_SENTINEL)
        if position < 0:
            raise TemplateNotAppendOnly("the chat template does not write an assistant message's content verbatim, "
                                        "so the model's sampled turn cannot be matched to its rendering")
        return text[position + len(_SENTINEL):]

    def _end_of_turn(self) -> str:
        special = set(self.tokenizer.all_special_tokens)
        special.update(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)
        starts = [token for token in special if token and self.assistant_close.startswith(token)]
        if not starts:
            raise TemplateNotAppendOnly(
                f"the chat template closes an assistant turn with {self.assistant_close!r}, which does not start with a "
                "special token, so the end of the model's generation cannot be found in the template's rendering of "
                "the turn; use a template that ends assistant turns with an end-of-turn token, or set "
                "model.episodes.end_of_turn to the text of the token generation stops on (\"\" for a template that "
                "does not write it, as tiny models' do)")
        return max(starts, key=len)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first prompt's ids: the conversation and the generation prompt of the first assistant turn."""
        text = self.render(messages, add_generation_prompt=True)
        ids = self._encode(text)
        unknown = self._unknown_words(text, ids)
        if unknown and not self._warned_unknown:
            self._warned_unknown = True  # once per run: every prompt of a task shows the same tools
            log.warning("an episode's prompt has %d tokens the tokenizer does not know (%s), read by the model as %s: "
                        "the tools' description or the prompt uses words outside its vocabulary (a tiny model's? set "
                        "model.episodes.system_prompt_for_tools: null and show the tools in the prompts)",
                        sum(i == self.tokenizer.unk_token_id for i in ids), ", ".join(map(repr, unknown[:5])),
                        self.tokenizer.unk_token)
        return ids

    def _unknown_words(self, text: str, ids: list[int]) -> list[str]:
        """The words of ``text`` that encode to the unknown token (none when the tokenizer has none)."""
        unk = self.tokenizer.unk_token_id
        if unk is None or unk not in ids:
            return []
        return sorted({word for word in text.split() if unk in self._encode(word)})

    def continuation_ids(self, messages_before: list[dict], new_messages: list[dict]) -> list[int]:
        """The ids to append after an assistant turn's sampled ids (which end with its end-of-turn token):
        the rest of the turn's closing, the environment's ``new_messages``, the next generation prompt.

        ``messages_before`` is the conversation so far, ending with that assistant turn
        ``{"role": "assistant", "content": text}``: the sampled ids decoded without the end-of-turn
        token, and no ``tool_calls`` field (the calls are in the text, as the model wrote them).
        """
        return self.continuation(messages_before, new_messages)[0]

    def continuation(self, messages_before: list[dict], new_messages: list[dict], rendered_so_far: Optional[str] = None
                     ) -> tuple[list[int], str]:
        """:meth:`continuation_ids` and the whole conversation's rendering it ends (generation prompt
        included). With ``rendered_so_far`` (that rendering from the previous turn, or the first
        prompt's text), a template that rewrites an earlier turn once a later assistant turn exists
        is refused too: the conversation so far must still render as it did when its ids were made."""
        if not messages_before or messages_before[-1].get("role") != "assistant":
            raise ConfigError("messages_before must end with the assistant turn just generated, "
                             f"got a last role of {messages_before[-1].get('role') if messages_before else None!r}")
        if self.end_of_turn and (messages_before[-1].get("content") or "").endswith(self.end_of_turn):
            raise ConfigError(f"the assistant turn's content ends with the end-of-turn token {self.end_of_turn!r}, which "
                             "the template writes itself; decode the sampled ids without it")
        before = self.render(messages_before, add_generation_prompt=False)
        after = self.render([*messages_before, *new_messages], add_generation_prompt=True)
        if not before.endswith(self.assistant_close):
            raise TemplateNotAppendOnly(f"the chat template does not end the last assistant turn with "
                                        f"{self.assistant_close!r} as it does a plain one; does that message carry "
                                        "fields (tool_calls) the template renders in its own way?")
        if not after.startswith(before):
            raise TemplateNotAppendOnly(self._explain_change(before, after, messages_before, new_messages))
        if rendered_so_far is not None and not before.startswith(rendered_so_far):
            raise TemplateNotAppendOnly(self._explain_change(rendered_so_far, before, messages_before[:-1],
                                                             messages_before[-1:]))
        suffix = after[len(before) - len(self.after_end_of_turn):]  # right after the end-of-turn token
        ids = self._encode(suffix)
        unknown = self._unknown_words(suffix, ids)
        if unknown:
            raise ConfigError(f"the environment's reply {suffix[:60]!r} has words the tokenizer does not know "
                              f"({', '.join(map(repr, unknown[:5]))}): the model would read {self.tokenizer.unk_token} "
                              "there and the reply could not be told apart from others; reply with words in the "
                              "model's vocabulary")
        decoded = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        # a word-level tokenizer's decode puts a space between tokens, special ones written together included
        if decoded != suffix and (self.keeps_whitespace or "".join(decoded.split()) != "".join(suffix.split())):
            raise ConfigError(f"tokenizing the environment's text {suffix[:60]!r} alone does not give that text back "
                             "(a tokenizer that adds a prefix space, or normalizes text?); its ids would not be the "
                             "ones the template's conversation has")
        return ids, after

    def _explain_change(self, before: str, after: str, messages_before: list[dict], new_messages: list[dict]) -> str:
        at = _common_prefix_length(before, after)
        roles = ", ".join(m.get("role", "?") for m in new_messages) or "no"
        thinking = any("</think>" in (m.get("content") or "") for m in messages_before if m.get("role") == "assistant")
        cause = ("it drops or rewrites <think> reasoning of earlier assistant turns (as Qwen3's template does for "
                 "turns before the last user message, and for an empty <think></think> once the turn is no longer "
                 "last)" if thinking or "<think>" in before[at:] else "it renders earlier turns differently once "
                 "more messages follow")
        return (f"the chat template is not append-only: adding {roles} message(s) after the assistant turn changes the "
                f"rendering of the conversation before them at character {at}: {before[max(0, at - 30):at + 30]!r} "
                f"became {after[max(0, at - 30):at + 30]!r}; {cause}. The ids the model sampled would no longer be "
                "the ones the template gives this conversation, so the episode cannot go on token-in/token-out. "
                "Fix: use a chat template that renders earlier turns unchanged (a training variant that keeps "
                "reasoning), or let episodes end after one assistant turn")


__all__ = ["ChatRenderer", "DEFAULT_TOOLS_SYSTEM_PROMPT", "TemplateNotAppendOnly", "template_reads_tools"]

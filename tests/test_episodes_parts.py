"""The engine-independent parts of multi-turn episodes: tools, the tool-call parser, the tool
environment, and the token-in/token-out chat renderer, with values worked out by hand."""

import json
import sys
import time
import types
from typing import Optional

import pytest

from gspo_lightning.episodes import (ChatRenderer, Environment, HermesToolCallParser, StepResult, TemplateNotAppendOnly,
                                     Tool, ToolCall, ToolEnvironment, ToolError, load_tools)


# ---------------------------------------------------------------- tools used by the tests
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "awake"


def scale(values: list[float], factor: Optional[float] = None) -> list:
    """Multiply values by a factor (default 2).

    Args:
        values: The numbers.
        factor: The factor.
    """
    return [v * (2 if factor is None else factor) for v in values]


async def shout(text: str) -> str:
    """Upper-case the text.

    Args:
        text: The text.
    """
    return text.upper()


def make_set() -> set:
    """Return a set, which JSON cannot hold."""
    return {1}


def untyped(a):
    """No type hint.

    Args:
        a: Anything.
    """


def undocumented(a: int) -> int:
    return a


@pytest.fixture
def tools_module(monkeypatch):
    """The tools above importable as ``episode_tools.<name>``, as a config names them."""
    module = types.ModuleType("episode_tools")
    for function in (add, divide, nap, make_set, untyped, undocumented):
        setattr(module, function.__name__, function)
    module.not_a_function = 3
    monkeypatch.setitem(sys.modules, "episode_tools", module)
    return module


# ---------------------------------------------------------------- tools
def test_schema_of_a_typed_function_is_get_json_schemas():
    assert Tool(add).schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first number."},
                                                        "b": {"type": "integer", "description": "The second number."}},
                       "required": ["a", "b"]},
        "return": {"type": "integer"}}}


def test_a_call_returns_text():
    assert Tool(add)({"a": 2, "b": 3}, timeout_s=1.0) == "5"  # not a string: as JSON
    assert Tool(divide)({"a": 1, "b": 4}, timeout_s=1.0) == "0.25"
    assert Tool(nap)({"seconds": 0}, timeout_s=1.0) == "awake"  # a string: as is


def test_optional_arguments_lists_and_async_tools():
    assert Tool(scale)({"values": [1, 2.5]}, timeout_s=1.0) == "[2, 5.0]"
    assert Tool(scale)({"values": [1], "factor": None}, timeout_s=1.0) == "[2]"  # nullable: None is allowed
    with pytest.raises(ToolError, match="argument 'values' of scale must be array, got 3"):
        Tool(scale)({"values": 3}, timeout_s=1.0)
    assert Tool(shout)({"text": "hi"}, timeout_s=1.0) == "HI"  # async def: run to completion in the worker


@pytest.mark.parametrize("arguments, kind, reason", [
    ({"a": 1}, "arguments", "missing a required argument: 'b'"),
    ({"a": 1, "b": 2, "c": 3}, "arguments", "unexpected keyword argument 'c'"),
    ({"a": "1", "b": 2}, "arguments", "argument 'a' of add must be integer, got \"1\""),
    ({"a": True, "b": 2}, "arguments", "argument 'a' of add must be integer, got true"),
    ([1, 2], "arguments", "arguments must be a JSON object, got list"),
])
def test_bad_arguments_are_a_tool_error(arguments, kind, reason):
    with pytest.raises(ToolError, match=reason) as caught:
        Tool(add)(arguments, timeout_s=1.0)
    assert caught.value.kind == kind


def test_a_tool_that_raises_is_a_tool_error_with_its_message():
    with pytest.raises(ToolError, match="^divide raised ZeroDivisionError: float division by zero$") as caught:
        Tool(divide)({"a": 1.0, "b": 0.0}, timeout_s=1.0)
    assert caught.value.kind == "raised"


def test_a_result_that_is_not_json_is_a_tool_error():
    with pytest.raises(ToolError, match="make_set returned a set, which is not JSON") as caught:
        Tool(make_set)({}, timeout_s=1.0)
    assert caught.value.kind == "result"


def test_a_hanging_tool_times_out():
    start = time.perf_counter()
    with pytest.raises(ToolError, match="^nap timed out after 0.2 s$") as caught:
        Tool(nap)({"seconds": 3}, timeout_s=0.2)
    assert caught.value.kind == "timeout"
    assert time.perf_counter() - start < 1.0  # the episode does not wait for the tool


def test_load_tools_from_import_paths_and_callables(tools_module):
    tools = load_tools(["episode_tools.add", "episode_tools:divide", nap])
    assert [tool.name for tool in tools] == ["add", "divide", "nap"]


@pytest.mark.parametrize("spec, reason", [
    ("no_such_module.add", "cannot import module 'no_such_module' of tool 'no_such_module.add'"),
    ("episode_tools.subtract", "module 'episode_tools' has no attribute 'subtract'"),
    ("episode_tools.not_a_function", "tool 'episode_tools.not_a_function' is a int, not a function"),
    ("add", "not an import path like 'package.module.function'"),
    ("episode_tools.untyped", "tool 'untyped' has no schema: Argument a is missing a type hint"),
    ("episode_tools.undocumented", "tool 'undocumented' has no schema: .*no docstring.*Google-style docstring"),
])
def test_load_tools_names_the_problem(tools_module, spec, reason):
    with pytest.raises(ValueError, match=reason):
        load_tools([spec])


def test_tool_names_are_unique():
    with pytest.raises(ValueError, match="two tools share the name 'add'"):
        load_tools([add, add])


# ---------------------------------------------------------------- parser
def test_hermes_parser_reads_several_calls_and_keeps_the_prose():
    text = ('Let me compute.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
            '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 4}}</tool_call>')
    turn = HermesToolCallParser().parse(text)
    assert turn.content == "Let me compute."
    assert turn.calls == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("divide", {"a": 1, "b": 4})]
    assert turn.errors == []


def test_hermes_parser_reports_malformed_calls_without_raising():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 2,}}</tool_call>'  # trailing comma
            '<tool_call>{"arguments": {}}</tool_call>'  # no name
            '<tool_call>{"name": "add", "arguments": "a=2"}</tool_call>'  # arguments not an object
            '<tool_call>["add"]</tool_call>'  # not an object
            '<tool_call>{"name": "now"}</tool_call>'  # no arguments: a call with none
            'done <tool_call>{"name": "add"')  # never closed
    turn = HermesToolCallParser().parse(text)
    assert turn.calls == [ToolCall("now", {})]
    assert turn.content == "done"
    assert len(turn.errors) == 5
    assert turn.errors[0].startswith("the tool call is not valid JSON (Expecting property name enclosed in double quotes")
    assert turn.errors[1] == 'the tool call has no "name": {"arguments": {}}'
    assert turn.errors[2] == 'the "arguments" of the call to add must be a JSON object, got "a=2"'
    assert turn.errors[3].startswith("the tool call must be a JSON object")
    assert turn.errors[4] == "a <tool_call> block is not closed by </tool_call>"


def test_text_without_calls_is_all_content():
    turn = HermesToolCallParser().parse("  The answer is 5. ")
    assert (turn.content, turn.calls, turn.errors) == ("The answer is 5.", [], [])


# ---------------------------------------------------------------- environments
def assistant(text):
    return {"role": "assistant", "content": text}


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_tool_environment_replies_to_each_call_in_order():
    env = ToolEnvironment([add, divide])
    result = env.step(assistant("Sure. " + call("add", a=2, b=3) + call("divide", a=1, b=4)))
    assert result == StepResult(messages=[{"role": "tool", "name": "add", "content": "5"},
                                          {"role": "tool", "name": "divide", "content": "0.25"}],
                                reward=None, done=False,
                                info={"tool_calls": 2, "tool_errors": 0, "tool_timeouts": 0, "malformed_tool_calls": 0})


def test_tool_environment_is_done_when_a_turn_makes_no_call():
    result = ToolEnvironment([add]).step(assistant("The answer is 5."))
    assert result.done and result.messages == []
    assert result.info == {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "malformed_tool_calls": 0}


def test_tool_environment_answers_every_fault_and_counts_it():
    env = ToolEnvironment([add, divide, nap], timeout_s=0.2, max_calls_per_turn=4)
    text = (call("divide", a=1, b=0) + call("subtract", a=1, b=2) + call("nap", seconds=3) + call("add", a="x", b=1)
            + call("add", a=1, b=1) + "<tool_call>{oops</tool_call>")
    result = env.step(assistant(text))
    assert not result.done  # the model gets its errors back and may try again
    assert [m.get("name") for m in result.messages] == ["divide", "subtract", "nap", "add", "add", None]
    contents = [m["content"] for m in result.messages]
    assert contents[0] == "Error: divide raised ZeroDivisionError: division by zero"  # JSON 1 and 0 are ints
    assert contents[1] == "Error: unknown tool 'subtract'; the tools are add, divide, nap"
    assert contents[2] == "Error: nap timed out after 0.2 s"
    assert contents[3] == "Error: argument 'a' of add must be integer, got \"x\""
    assert contents[4] == "Error: at most 4 tool calls per turn; this call was not run"
    assert contents[5].startswith("Error: the tool call is not valid JSON")
    assert result.info == {"tool_calls": 6, "tool_errors": 6, "tool_timeouts": 1, "malformed_tool_calls": 1}


def test_calls_drafted_while_reasoning_are_not_made():
    text = "<think>\nMaybe " + call("add", a=1, b=1) + "? No.\n</think>\n\n" + call("add", a=2, b=3)
    result = ToolEnvironment([add]).step(assistant(text))
    assert [m["content"] for m in result.messages] == ["5"] and result.info["tool_calls"] == 1


def test_only_malformed_calls_do_not_end_the_episode():
    result = ToolEnvironment([add]).step(assistant("<tool_call>add(1, 2)</tool_call>"))
    assert not result.done and len(result.messages) == 1


def test_tool_environment_from_a_config(tools_module):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--environment", type=Environment)
    config = parser.parse_object({"environment": {
        "class_path": "gspo_lightning.episodes.ToolEnvironment",
        "init_args": {"tools": ["episode_tools.add"], "timeout_s": 2.0,
                      "parser": {"class_path": "gspo_lightning.episodes.HermesToolCallParser"}}}})
    template = parser.instantiate(config).environment
    assert isinstance(template, ToolEnvironment) and isinstance(template.parser, HermesToolCallParser)
    assert template.timeout_s == 2.0 and template.tools_schema == [Tool(add).schema]
    episode = template.fresh()  # one instance per episode; the loaded tools are shared
    assert episode is not template and episode.tools is template.tools
    assert episode.step(assistant(call("add", a=1, b=2))).messages[0]["content"] == "3"


class CountingEnvironment(Environment):
    """An environment with per-episode state: fresh() deep-copies it."""

    def __init__(self, target: int = 3):
        self.target = target
        self.turns = 0

    def reset(self, row, prompt):
        return [*prompt, {"role": "user", "content": f"Count to {row['n']}."}]

    def step(self, assistant_message):
        self.turns += 1
        done = self.turns >= self.target
        return StepResult(messages=[] if done else [{"role": "user", "content": "Go on."}],
                          reward=1.0 if done else 0.0, done=done)


def test_an_environment_instance_serves_one_episode():
    template = CountingEnvironment(target=2)
    first, second = template.fresh(), template.fresh()
    assert first.reset({"n": 2}, []) == [{"role": "user", "content": "Count to 2."}]
    assert not first.step(assistant("1")).done and first.step(assistant("2")).done
    assert second.turns == 0 and template.turns == 0
    prompt = [{"role": "user", "content": "x"}]
    assert Environment().reset({"prompt": "x"}, prompt) == prompt and Environment().tools_schema is None


# ---------------------------------------------------------------- chat renderer
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>"]

# SmolLM2 / Qwen2 ChatML; no tools section
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Llama-3 style: BOS, headers, <|eot_id|> with nothing after it, tool results as "ipython", tools= read
LLAMA3 = ("{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n"
          "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
          "{% for message in messages %}{% set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
          "<|start_header_id|>{{ role }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Qwen3 style as the issue describes it: <think>...</think> is dropped from assistant turns that are not
# the last message; tool results are wrapped in a user turn
QWEN3_STYLE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if not loop.last and '</think>' in content %}{% set content = content.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}<|im_start|>assistant\n{{ content }}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen3's own rules, written afresh: reasoning is kept only on assistant turns after the last user message,
# and the last message, when an assistant turn, always shows a <think> block (empty if it had none)
QWEN3_RULES = (
    "{% set ns = namespace(last_user=-1) %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set content = message['content'] %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\n') %}{% endif %}"
    "<|im_start|>assistant\n{% if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "<think>\n{{ reasoning }}\n</think>\n\n{% endif %}{{ content }}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tokenizer(chat_template):
    """A byte-level BPE with a few merges and the chat special tokens; built here, nothing downloaded."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [("Ċ", "Ċ"), ("a", "d"), ("ad", "d"), ("Ġ", "i"), ("Ġi", "s")]
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]
TURN = 'I will add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
REPLY = [{"role": "tool", "name": "add", "content": "5"}]


def test_chatml_prompt_shows_tools_in_a_system_message():
    renderer = ChatRenderer(build_tokenizer(CHATML), tools_schema=[Tool(add).schema])
    assert not renderer.template_reads_tools
    text = renderer.render(QUESTION, add_generation_prompt=True)
    schema = json.dumps(Tool(add).schema)
    assert text == ("<|im_start|>system\nYou can call tools (functions) to help with the request. The tools, one JSON "
                    f"schema per line:\n{schema}\nTo call a tool, write a JSON object with its name and arguments "
                    "between <tool_call> and </tool_call>:\n"
                    '<tool_call>{"name": "tool_name", "arguments": {"argument_name": "value"}}</tool_call>\n'
                    "Each call's result comes back in a message from the tool.<|im_end|>\n"
                    "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # merged into the conversation's own system message; none at all when the prompt is None
    merged = renderer.render([{"role": "system", "content": "Be brief."}, *QUESTION], add_generation_prompt=False)
    assert merged.startswith("<|im_start|>system\nBe brief.\n\nYou can call tools") and merged.count("system") == 1
    plain = ChatRenderer(build_tokenizer(CHATML), tools_schema=[Tool(add).schema], system_prompt_for_tools=None)
    assert plain.render(QUESTION, add_generation_prompt=False) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"


def test_chatml_continuation_starts_after_the_sampled_end_of_turn_token():
    tokenizer = build_tokenizer(CHATML)
    renderer = ChatRenderer(tokenizer)
    assert (renderer.end_of_turn, renderer.after_end_of_turn) == ("<|im_end|>", "\n")
    prompt = renderer.prompt_ids(QUESTION)
    assert prompt == encode(tokenizer, "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    sampled = encode(tokenizer, TURN + "<|im_end|>")  # the engine stops on <|im_end|>
    conversation = [*QUESTION, assistant(TURN)]
    continuation = renderer.continuation_ids(conversation, REPLY)
    # the "\n" the template writes after <|im_end|>, the tool turn, the next generation prompt
    assert continuation == encode(tokenizer, "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    assert continuation[0] == tokenizer.convert_tokens_to_ids("Ċ")
    full = renderer.render([*conversation, *REPLY], add_generation_prompt=True)
    assert prompt + sampled + continuation == encode(tokenizer, full)


def test_chatml_two_tool_turns_concatenate_to_the_whole_conversation():
    tokenizer = build_tokenizer(CHATML)
    renderer = ChatRenderer(tokenizer, tools_schema=[Tool(add).schema])
    second_turn = "It is 5."
    conversation = [*QUESTION, assistant(TURN)]
    ids = renderer.prompt_ids(QUESTION) + encode(tokenizer, TURN + "<|im_end|>")
    ids += renderer.continuation_ids(conversation, REPLY)
    conversation += [*REPLY, assistant(second_turn)]
    ids += encode(tokenizer, second_turn + "<|im_end|>")
    ids += renderer.continuation_ids(conversation, [{"role": "user", "content": "Thanks."}])
    full = renderer.render([*conversation, {"role": "user", "content": "Thanks."}], add_generation_prompt=True)
    assert ids == encode(tokenizer, full)


def test_llama3_continuation_has_nothing_between_eot_and_the_next_header():
    tokenizer = build_tokenizer(LLAMA3)
    renderer = ChatRenderer(tokenizer, tools_schema=[Tool(add).schema])
    assert renderer.template_reads_tools  # shown through tools=, no system message of ours
    assert (renderer.end_of_turn, renderer.after_end_of_turn) == ("<|eot_id|>", "")
    prompt = renderer.prompt_ids(QUESTION)
    assert tokenizer.decode(prompt) == (
        f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nTools:\n{json.dumps(Tool(add).schema)}\n"
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prompt[0] == tokenizer.bos_token_id and prompt.count(tokenizer.bos_token_id) == 1  # BOS once, from the template
    sampled = encode(tokenizer, TURN + "<|eot_id|>")
    conversation = [*QUESTION, assistant(TURN)]
    continuation = renderer.continuation_ids(conversation, REPLY)
    assert continuation == encode(tokenizer, "<|start_header_id|>ipython<|end_header_id|>\n\n5<|eot_id|>"
                                             "<|start_header_id|>assistant<|end_header_id|>\n\n")
    full = renderer.render([*conversation, *REPLY], add_generation_prompt=True)
    ids = prompt + sampled + continuation
    assert tokenizer.decode(ids) == full
    # where tokenization is not stable: this tokenizer (GPT-2's split rule) merges the generation prompt's
    # "\n\n" into one token at the end of a text, but not before a letter. The engine sampled after the
    # merged token, so those are the ids trained on; re-tokenizing the whole text would change them.
    newline, two_newlines = tokenizer.convert_tokens_to_ids(["Ċ", "ĊĊ"])
    assert prompt[-1] == two_newlines and continuation[-1] == two_newlines
    assert encode(tokenizer, full) == prompt[:-1] + [newline, newline] + sampled + continuation


def test_qwen3_style_continues_a_turn_without_thinking():
    tokenizer = build_tokenizer(QWEN3_STYLE)
    renderer = ChatRenderer(tokenizer, tools_schema=[Tool(add).schema])
    assert renderer.template_reads_tools
    conversation = [*QUESTION, assistant(TURN)]
    continuation = renderer.continuation_ids(conversation, REPLY)
    assert continuation == encode(tokenizer, "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                             "<|im_start|>assistant\n")
    full = renderer.render([*conversation, *REPLY], add_generation_prompt=True)
    assert renderer.prompt_ids(QUESTION) + encode(tokenizer, TURN + "<|im_end|>") + continuation == encode(tokenizer, full)


def test_qwen3_style_refuses_a_turn_whose_thinking_the_template_drops():
    renderer = ChatRenderer(build_tokenizer(QWEN3_STYLE))
    thought = "<think>\n2 plus 3.\n</think>\n\n" + TURN
    with pytest.raises(TemplateNotAppendOnly) as caught:
        renderer.continuation_ids([*QUESTION, assistant(thought)], REPLY)
    message = str(caught.value)
    assert message.startswith("the chat template is not append-only: adding tool message(s) after the assistant turn "
                              "changes the rendering of the conversation before them at character 64: ")  # len(user turn) 42 + 22
    assert "<|im_start|>assistant\\n<think>\\n2 plus 3.\\n</think>\\n\\nI ' became" in message  # before
    assert "became 'm_end|>\\n<|im_start|>assistant\\nI will add. <tool_call>" in message  # after: no thinking
    assert "it drops or rewrites <think> reasoning of earlier assistant turns" in message
    assert "Fix: use a chat template that renders earlier turns unchanged" in message


def test_qwen3_rules_keep_thinking_within_a_tool_loop_but_refuse_an_empty_think_block():
    """Qwen3's own rules: a turn with reasoning followed by tool results is append-only (reasoning after
    the last user message is kept); a turn without it is not (its empty <think> block disappears once it is
    no longer the last message); a turn with reasoning followed by a user message is not either."""
    tokenizer = build_tokenizer(QWEN3_RULES)
    renderer = ChatRenderer(tokenizer)
    thought = "<think>\n2 plus 3.\n</think>\n\n" + TURN
    conversation = [*QUESTION, assistant(thought)]
    continuation = renderer.continuation_ids(conversation, REPLY)
    full = renderer.render([*conversation, *REPLY], add_generation_prompt=True)
    assert renderer.prompt_ids(QUESTION) + encode(tokenizer, thought + "<|im_end|>") + continuation == encode(tokenizer, full)
    with pytest.raises(TemplateNotAppendOnly, match="<think>"):
        renderer.continuation_ids([*QUESTION, assistant(TURN)], REPLY)
    with pytest.raises(TemplateNotAppendOnly, match="drops or rewrites <think> reasoning"):
        renderer.continuation_ids(conversation, [{"role": "user", "content": "And 4 + 4?"}])


def test_a_template_without_an_end_of_turn_token_is_refused():
    no_terminator = ("{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}[assistant] {% endif %}")
    with pytest.raises(TemplateNotAppendOnly, match=r"closes an assistant turn with '\\n', which does not start with "
                                                    r"a special token.*set model.episodes.end_of_turn"):
        ChatRenderer(build_tokenizer(no_terminator))


def test_continuation_needs_the_assistant_turn_last_without_its_end_of_turn_token():
    tokenizer = build_tokenizer(CHATML)
    renderer = ChatRenderer(tokenizer)
    assert renderer.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match="must end with the assistant turn just generated, got a last role of 'user'"):
        renderer.continuation_ids(QUESTION, REPLY)
    with pytest.raises(ValueError, match="content ends with the end-of-turn token '<\\|im_end\\|>'.*decode the sampled ids "
                                         "without it"):
        renderer.continuation_ids([*QUESTION, assistant(TURN + "<|im_end|>")], REPLY)


def test_every_public_name_of_episodes_resolves():
    import gspo_lightning.episodes as episodes

    assert all(getattr(episodes, name) is not None for name in episodes.__all__)


def test_the_parts_assemble_an_episode_token_in_token_out():
    """How a runner puts them together: scripted turns stand in for the engine's samples."""
    tokenizer = build_tokenizer(CHATML)
    template = ToolEnvironment([add, divide])
    env = template.fresh()
    renderer = ChatRenderer(tokenizer, tools_schema=env.tools_schema)
    messages = env.reset({"prompt": "What is 2 + 3?"}, list(QUESTION))
    ids = renderer.prompt_ids(messages)
    mask = [0] * len(ids)
    scripted = iter([TURN, call("divide", a=5, b=0), "It is 5."])
    for turn in range(4):  # max_turns
        text = next(scripted)
        sampled = encode(tokenizer, text) + [renderer.end_of_turn_id]  # the engine's ids, stopped on <|im_end|>
        ids += sampled
        mask += [1] * len(sampled)
        messages.append(assistant(tokenizer.decode(sampled, skip_special_tokens=True)))
        result = env.step(messages[-1])
        if result.done:
            break
        continuation = renderer.continuation_ids(messages, result.messages)
        ids += continuation
        mask += [0] * len(continuation)
        messages += result.messages
    assert turn == 2 and result.done
    assert [m["content"] for m in messages if m["role"] == "tool"] == [
        "5", "Error: divide raised ZeroDivisionError: division by zero"]
    assert tokenizer.decode(ids) == renderer.render(messages, add_generation_prompt=False).removesuffix("\n")
    assert sum(mask) == sum(len(encode(tokenizer, t)) + 1 for t in (TURN, call("divide", a=5, b=0), "It is 5."))
    assert ids == encode(tokenizer, renderer.render(messages, add_generation_prompt=False))[:-1]  # all but the final "\n"


def test_words_a_tiny_tokenizer_does_not_know_are_named_a_warning_in_prompts_and_an_error_in_replies(caplog):
    """A tiny word-level vocabulary reads a word it does not know as <unk>: a prompt (a tool schema
    shown in words it lacks) is warned about once, with the count; a reply is refused, naming the
    words (not a prefix-space problem)."""
    import logging

    from gspo_lightning.models.tiny import build_tokenizer as build_tiny_tokenizer
    from gspo_lightning.models.tiny import get_spec

    renderer = ChatRenderer(build_tiny_tokenizer(get_spec("tiny-lookup")), end_of_turn="")
    with caplog.at_level(logging.WARNING, logger="gspo_lightning.episodes.template"):
        renderer.prompt_ids([{"role": "user", "content": "find c please now"}])
        renderer.prompt_ids([{"role": "user", "content": "find d quickly"}])
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings  # once per run
    assert "has 2 tokens the tokenizer does not know ('now', 'please')" in warnings[0]
    assert "system_prompt_for_tools: null" in warnings[0]
    before = [{"role": "user", "content": "find c"}, {"role": "assistant", "content": "get c"}]
    with pytest.raises(ValueError, match=r"has words the tokenizer does not know \('Error:', 'unknown'\)"):
        renderer.continuation_ids(before, [{"role": "tool", "content": "Error: unknown c"}])

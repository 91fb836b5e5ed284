"""Tools: plain typed Python functions with docstrings, called with the arguments a model wrote.

The schema the model is shown is the one ``transformers.utils.get_json_schema`` builds from
the signature and the Google-style docstring (as ``apply_chat_template(tools=[fn])`` does), so a
tool needs type hints on every argument and an ``Args:`` entry for each:

.. code-block:: python

    def add(a: int, b: int) -> int:
        \"\"\"Add two integers.

        Args:
            a: The first number.
            b: The second number.
        \"\"\"
        return a + b

A call never raises anything but :class:`ToolError`, whose short message becomes the tool's
reply to the model: bad or missing arguments, an exception inside the tool, a result that is
not JSON, or a call that outlived its timeout.

Calls run side by side: the episode runner steps every live episode's environment at once, and
a turn's calls may run together (``ToolEnvironment(parallel_calls=true)``). ``async def`` tools are
awaited on the runner's event loop and cancelled at their timeout. A plain function runs in a
daemon thread of its own and is waited for until ``timeout_s``. Python cannot kill a thread: a
hung tool keeps running (and holding what it holds) until it returns, but the episode goes on, the
interpreter does not wait for it at exit, and once ``max_hung`` calls of a tool are still running
past their timeout, its next calls are answered with an error instead of starting another thread,
so hung calls never pile up threads without bound. A process per call could be killed, but it
costs a fork or a spawn per call (tens of milliseconds, and fork is unsafe in a trainer with CUDA
and threads) and needs picklable functions; tools that can truly hang (network, subprocesses)
should bound themselves and use this timeout as the backstop. How many calls run at once in all
is the runner's ``episodes.max_concurrent_tools`` (:data:`tool_slots`).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import json
import threading
from typing import Any, Callable, Optional, Union

from gspo_lightning._imports import import_callable
from gspo_lightning.errors import ConfigError

# a reply the model reads: long tracebacks would only eat the episode's token budget
MAX_ERROR_CHARS = 300

# The calls that may run at once, set by the episode runner around a turn's environment steps (a
# semaphore of episodes.max_concurrent_tools slots); None: no bound (a tool called directly)
tool_slots: contextvars.ContextVar[Optional[asyncio.Semaphore]] = contextvars.ContextVar("tool_slots", default=None)

# JSON-schema type -> the Python types a JSON decoder gives for it (bool is not a number here)
_JSON_TYPES = {"integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


class ToolError(Exception):
    """A tool call that failed; ``str(error)`` is the short reason shown to the model.

    ``kind`` says which fault it was: ``"arguments"``, ``"raised"``, ``"result"`` or ``"timeout"``.
    """

    def __init__(self, message: str, kind: str):
        super().__init__(message[:MAX_ERROR_CHARS])
        self.kind = kind


def _matches(value: Any, schema_type: Union[str, list, None]) -> bool:
    if schema_type is None:
        return True
    types = schema_type if isinstance(schema_type, list) else [schema_type]
    for name in types:
        python_types = _JSON_TYPES.get(name)
        if python_types is None:
            return True  # a type this check does not know: let the tool decide
        if isinstance(value, python_types) and not (isinstance(value, bool) and name in ("integer", "number")):
            return True
    return False


class _HungCalls:
    """The calls of one tool still running after their timeout (each holds a thread)."""

    def __init__(self):
        self.count = 0
        self.lock = threading.Lock()


class Tool:
    """A callable the model may call by name, with the JSON schema it is shown.

    Args:
        function: a typed function (or ``async def``) with a Google-style docstring.
        max_hung: calls of this tool that may still be running past their timeout (each holds a
            thread) before the next call is refused with an error.
        as_text: how a result that is not a string becomes the reply (default: JSON).
    """

    def __init__(self, function: Callable, max_hung: int = 8, as_text: Optional[Callable[[Any], str]] = None):
        self.function = function
        self.schema = schema_of(function)
        self.name: str = self.schema["function"]["name"]
        self.max_hung = max_hung
        self.as_text = as_text
        self._signature = inspect.signature(function)
        self._hung = _HungCalls()

    def bound_to(self, function: Callable) -> "Tool":
        """This tool calling ``function`` instead (the same method of another instance): the schema
        is not built again, and the calls still running past their timeout are counted together."""
        tool = copy.copy(self)
        tool.function = function
        return tool

    def __repr__(self) -> str:
        return f"Tool({self.name})"

    def check_arguments(self, arguments: Any) -> dict:
        """``arguments`` if they bind to the signature with the schema's top-level types, else a ToolError."""
        if not isinstance(arguments, dict):
            raise ToolError(f"arguments must be a JSON object, got {type(arguments).__name__}", kind="arguments")
        try:
            self._signature.bind(**arguments)
        except TypeError as err:
            raise ToolError(f"bad arguments for {self.name}: {err}", kind="arguments") from None
        properties = self.schema["function"].get("parameters", {}).get("properties", {})
        for key, value in arguments.items():
            expected = properties.get(key, {}).get("type")
            if value is None and properties.get(key, {}).get("nullable"):  # an Optional[...] argument
                continue
            if not _matches(value, expected):
                raise ToolError(f"argument {key!r} of {self.name} must be {expected}, got {json.dumps(value)[:40]}",
                                kind="arguments")
        return arguments

    def __call__(self, arguments: dict, timeout_s: float) -> Union[str, list[dict]]:
        """Run the tool from plain code (a fresh event loop); its result as text."""
        return asyncio.run(self.acall(arguments, timeout_s))

    async def acall(self, arguments: dict, timeout_s: float) -> Union[str, list[dict]]:
        """Run the tool: its result as text (a string as is, anything else by ``as_text``), or, for
        a PIL image, a message content with that image as its one part (for a vision-language policy)."""
        arguments = self.check_arguments(arguments)
        slots = tool_slots.get()
        if slots is None:
            return self._text(await self._run(arguments, timeout_s))
        async with slots:
            return self._text(await self._run(arguments, timeout_s))

    async def _run(self, arguments: dict, timeout_s: float) -> Any:
        if inspect.iscoroutinefunction(self.function):
            task = asyncio.ensure_future(self.function(**arguments))
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                task.cancel()  # an async tool is stopped at its timeout, not left running
                raise ToolError(f"{self.name} timed out after {timeout_s:g} s", kind="timeout")
            return self._outcome(task.result)
        return await self._run_in_thread(arguments, timeout_s)

    async def _run_in_thread(self, arguments: dict, timeout_s: float) -> Any:
        hung = self._hung
        with hung.lock:
            if hung.count >= self.max_hung:
                raise ToolError(f"{self.name} was not run: {hung.count} earlier calls are still running past their "
                                "timeout", kind="timeout")
        loop = asyncio.get_running_loop()
        finished = loop.create_future()
        state: dict[str, Any] = {"timed_out": False}

        def settle(outcome: tuple) -> None:
            if not finished.done():
                finished.set_result(outcome)

        def run():
            try:
                result = self.function(**arguments)
                outcome = ("value", asyncio.run(result) if inspect.iscoroutine(result) else result)
            except BaseException as err:  # noqa: BLE001 - whatever it raises is the tool's reply
                outcome = ("error", err)
            with hung.lock:  # the waiter's timeout and this end are decided under one lock
                if state["timed_out"]:
                    hung.count -= 1
                    return
                state["outcome"] = outcome
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the loop that waited is gone
                pass

        threading.Thread(target=run, name=f"tool-{self.name}", daemon=True).start()
        try:
            kind, value = await asyncio.wait_for(asyncio.shield(finished), timeout_s)
        except asyncio.TimeoutError:
            with hung.lock:
                if "outcome" in state:  # it finished as the wait ended
                    kind, value = state["outcome"]
                else:
                    state["timed_out"] = True
                    hung.count += 1
                    raise ToolError(f"{self.name} timed out after {timeout_s:g} s", kind="timeout") from None
        return self._outcome(lambda: self._raise(value) if kind == "error" else value)

    @staticmethod
    def _raise(err: BaseException):
        raise err

    def _outcome(self, get: Callable[[], Any]) -> Any:
        try:
            return get()
        except BaseException as err:  # noqa: BLE001 - whatever it raises (SystemExit too) is the tool's reply
            raise ToolError(f"{self.name} raised {type(err).__name__}: {err}", kind="raised") from None

    def _text(self, value: Any) -> Union[str, list[dict]]:
        if isinstance(value, str):
            return value
        if _is_image(value):  # a vision-language policy sees it: the reply is an image part
            return [{"type": "image", "image": value}]
        if self.as_text is not None:
            return self.as_text(value)
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as err:
            raise ToolError(f"{self.name} returned a {type(value).__name__}, which is not JSON: {err}",
                            kind="result") from None


def _is_image(value: Any) -> bool:
    """Whether ``value`` is a PIL image (without importing PIL for tools that never return one)."""
    return any(cls.__module__.startswith("PIL.") and cls.__name__ == "Image" for cls in type(value).__mro__)


def schema_of(function: Callable) -> dict:
    """The function schema ``get_json_schema`` builds, or a ValueError that says what to add."""
    from transformers.utils import get_json_schema

    name = getattr(function, "__name__", repr(function))
    try:
        return get_json_schema(function)
    except Exception as err:  # TypeHintParsingException, DocstringParsingException
        raise ConfigError(f"tool {name!r} has no schema: {err}. A tool needs a type hint on every argument and a "
                         "Google-style docstring with a description and an 'Args:' line per argument") from err


def import_tool(path: str) -> Callable:
    """The function at ``package.module.function`` (or ``package.module:function``)."""
    return import_callable(path, "tool")


def load_tools(specs: list[Union[str, Callable]], **options) -> list[Tool]:
    """Tools from import paths or callables (``options``: :class:`Tool`'s); names must be unique
    (the model calls them by name)."""
    tools = [Tool(import_tool(spec) if isinstance(spec, str) else spec, **options) for spec in specs]
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"two tools share the name {', '.join(map(repr, duplicates))}; rename one of them")
    return tools


__all__ = ["Tool", "ToolError", "import_tool", "load_tools", "schema_of", "tool_slots"]

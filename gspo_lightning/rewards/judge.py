"""An LLM judge behind an OpenAI-compatible endpoint (a vLLM server, a hosted API) as a reward.

.. code-block:: yaml

    rewards:
      - function: gspo_lightning.rewards.LLMJudge
        factory: true
        kwargs:
          base_url: http://127.0.0.1:8000/v1
          model: judge
          prompt: "Question: {prompt}\\nAnswer: {completion}\\nReference: {answer}\\nScore 0-10:"
          scale: [0, 10]          # the judge's 0-10 mapped to 0-1
          max_concurrency: 8      # requests in flight at most
          timeout_s: 60           # per request; then up to max_retries more tries

Each completion is one request (``group: true``: one request per group, the judge scoring every
response of it, as RULER does). A reply the pattern does not find a score in, or a request that
still fails after its retries, gives ``None`` (the sample unscored, not 0), counted in
``reward/<name>/failed`` and printed once per kind of failure; more than half of a step's samples failing
stops the run with a checkpoint and one line naming the endpoint (the rollout's check, in
``RewardComposer.pop_failure_counts``: a step scored group by group counts its whole batch).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import string
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence

from gspo_lightning.errors import ConfigError
from gspo_lightning.rewards.base import FailureCounts, close_with, is_conversational, is_long_lived

NUMBER = r"-?\d+(?:\.\d+)?"
# group mode: one "Response <i>: <score>" line per response of the group
GROUP_PATTERN = r"(?i)response\s*(\d+)\s*[:=-]\s*(" + NUMBER + r")"
RETRIED_STATUSES = (408, 429, 500, 502, 503, 504)
MAX_REPLY_BYTES = 1 << 20  # a judge's reply is a few tokens; more is a misconfigured or hostile endpoint
FIXED_FIELDS = ("prompt", "completion", "completions")


def render_text(value: Any) -> str:
    """A prompt or completion as the judge reads it: text as it is; chat messages (an episode's
    conversation) as ``role: content`` lines, a single message as its bare content."""
    if not is_conversational(value):
        return str(value)
    if len(value) == 1:
        return str(value[0].get("content") or "")
    return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in value)


def template_fields(template: str, where: str = "kwargs.prompt") -> set[str]:
    """The ``{name}`` fields of a ``str.format`` template; a malformed one is a config error."""
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ConfigError(f"LLMJudge {where}: {err} (write a literal brace as {{{{ or }}}})") from None
    bad = [name for name in fields if not name.isidentifier()]
    if bad:
        raise ConfigError(f"LLMJudge {where}: fields {bad} are not plain names; use {{prompt}}, {{completion}} "
                          f"or a dataset column's name (write a literal brace as {{{{ or }}}})")
    return fields


class LLMJudge:
    """Scores completions by asking an LLM served behind an OpenAI-compatible endpoint.

    Args:
        base_url: the endpoint's ``/v1`` URL (``http://127.0.0.1:8000/v1``).
        model: the model name the endpoint serves (``vllm serve ... --served-model-name``).
        prompt: a ``str.format`` template over ``{prompt}``, ``{completion}`` (an episode: its
            conversation as text) and any dataset column; ``group: true`` gives ``{completions}``
            (the group's responses numbered ``Response 1:`` ...) instead of ``{completion}``.
        score_pattern: a regular expression whose first group (or whole match) is the score;
            default: the first number of the reply (group mode: ``Response <i>: <score>`` lines).
        scale: ``[low, high]`` of the judge's scores, mapped to 0-1; a score outside is a failure.
        system_prompt: an optional system message before the prompt.
        api_key_env: the environment variable holding the endpoint's key (never the key itself).
        temperature, max_tokens: the judge's sampling.
        max_concurrency: requests in flight at most.
        timeout_s: one request's limit (so a sample waits at most about ``(max_retries + 1) x
            timeout_s`` plus the back-offs).
        max_retries: further tries of a request that timed out, could not connect, or got HTTP
            408, 429 or 5xx (after 0.5 s, 1 s, 2 s, ... up to 8 s); other statuses are not retried.
        group: one request per group of responses to the same prompt, one score per response.
        check_endpoint: ask the endpoint for its models when the run starts (an unreachable
            endpoint, a refused key or a model it does not serve stops the run there).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        prompt: str,
        *,
        score_pattern: Optional[str] = None,
        scale: Optional[Sequence[float]] = None,
        system_prompt: Optional[str] = None,
        api_key_env: Optional[str] = None,
        temperature: float = 0.0,
        max_tokens: int = 64,
        max_concurrency: int = 8,
        timeout_s: float = 60.0,
        max_retries: int = 2,
        group: bool = False,
        check_endpoint: bool = True,
    ):
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"LLMJudge base_url must be an http(s) URL ending in /v1, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.prompt = prompt
        self.system_prompt = system_prompt
        self.fields = template_fields(prompt)
        wrong = "completion" if group else "completions"
        if wrong in self.fields:
            raise ConfigError(f"LLMJudge prompt: {{{wrong}}} is the field of group: {str(not group).lower()}; "
                              f"use {{{'completions' if group else 'completion'}}}")
        try:
            self.pattern = re.compile(score_pattern or (GROUP_PATTERN if group else NUMBER))
        except re.error as err:
            raise ConfigError(f"LLMJudge score_pattern {score_pattern!r} is not a regular expression: {err}") from None
        if scale is not None and (len(scale) != 2 or float(scale[1]) <= float(scale[0])):
            raise ConfigError(f"LLMJudge scale must be [low, high] with low < high, got {scale!r}")
        self.scale = None if scale is None else (float(scale[0]), float(scale[1]))
        if max_concurrency < 1 or timeout_s <= 0 or max_retries < 0 or max_tokens < 1:
            raise ConfigError("LLMJudge: max_concurrency and max_tokens must be >= 1, timeout_s > 0, max_retries >= 0")
        self.api_key = None
        if api_key_env is not None:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise ConfigError(f"LLMJudge api_key_env={api_key_env!r}: that environment variable is not set; "
                                  f"export it with the judge endpoint's key")
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.group = group
        self._limit_loop = self._loop_limit = None  # the event loop the max_concurrency bound is for
        self._session_loop = self._session = None  # a long-lived loop's session (rewards/base.py: is_long_lived)
        self.failures = FailureCounts(f"LLM judge at {self.base_url}")
        self.pop_failures = self.failures.pop  # reward/<name>/failed: samples unscored since the last call
        self._columns_checked = False
        if check_endpoint:
            self.check_endpoint()

    # -- the run's start -----------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def check_endpoint(self) -> None:
        """``GET /models``: the endpoint answers, takes the key and serves ``model``."""
        request = urllib.request.Request(f"{self.base_url}/models", headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout_s, 10.0)) as reply:
                body = reply.read(1 << 20)
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                raise ConfigError(f"LLMJudge: the endpoint {self.base_url} refused the key (HTTP {err.code}); "
                                  f"set api_key_env to the variable holding its key") from None
            return  # it answers; an endpoint without /models is still usable
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ConfigError(f"LLMJudge: nothing answers at {self.base_url} ({reason}); start the judge's server "
                              f"first, or fix kwargs.base_url (or set check_endpoint: false)") from None
        try:
            served = [m["id"] for m in json.loads(body)["data"]]
        except (ValueError, KeyError, TypeError):
            return
        if served and self.model not in served:
            raise ConfigError(f"LLMJudge: {self.base_url} serves {served}, not {self.model!r}: set kwargs.model")

    def check_columns(self, columns: Sequence[str]) -> None:
        """Every template field is ``prompt``, ``completion(s)`` or one of the dataset's ``columns``."""
        missing = sorted(self.fields - set(FIXED_FIELDS) - set(columns))
        if missing:
            raise ConfigError(f"LLMJudge prompt: field(s) {missing} are no dataset column (columns: {sorted(columns)}); "
                              f"use {{prompt}}, {{{'completions' if self.group else 'completion'}}} or a column")

    # -- scoring -------------------------------------------------------------------------
    async def __call__(self, prompts: list, completions: list, **columns) -> list[Optional[float]]:
        if not self._columns_checked:
            self.check_columns([key for key in columns if key != "completion_ids"])
            self._columns_checked = True
        n = len(completions)
        limit = self._limit()
        loop = asyncio.get_running_loop()
        if is_long_lived(loop):  # the worker's reward loop: one session, its connections kept from call to call
            scores, reasons = await self._score_all(self._loop_session(loop), limit, prompts, completions, columns)
        else:  # a loop of this call alone (asyncio.run): a session of its own, closed with it
            async with self._new_session() as session:
                scores, reasons = await self._score_all(session, limit, prompts, completions, columns)
        for score, reason in zip(scores, reasons):
            if score is None:  # counted; the rollout's majority check (RewardComposer.pop_failure_counts) stops a run
                self.failures.add(reason.split(": ")[0], reason)  # kinds: timeout, HTTP 503, connection, no score, ...
        return scores

    def _new_session(self):
        import aiohttp

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_concurrency), headers=self._headers())

    def _loop_session(self, loop):
        if self._session_loop is not loop or self._session.closed:
            self._session_loop, self._session = loop, self._new_session()
            close_with(loop, self._session.close)
        return self._session

    async def _score_all(self, session, limit, prompts: list, completions: list, columns: dict
                         ) -> tuple[list[Optional[float]], list[Optional[str]]]:
        """Every sample's score (``None`` where it failed) and the reason of each failure."""
        n = len(completions)
        if self.group:
            groups = _groups(prompts)
            replies = await asyncio.gather(*(self._judge_group(session, limit, prompts, completions, columns, rows)
                                             for rows in groups))
            scores: list[Optional[float]] = [None] * n
            reasons: list[Optional[str]] = [None] * n
            for rows, (group_scores, reason) in zip(groups, replies):
                for i, score in zip(rows, group_scores):
                    scores[i], reasons[i] = score, reason
        else:
            results = await asyncio.gather(*(self._judge_one(session, limit, prompts, completions, columns, i)
                                              for i in range(n)))
            scores = [score for score, _ in results]
            reasons = [reason for _, reason in results]
        return scores, reasons

    def _limit(self) -> asyncio.Semaphore:
        """The ``max_concurrency`` bound of the running event loop: one for every batch scored on
        it at once (the groups of a step scored as they finish share it)."""
        loop = asyncio.get_running_loop()
        if self._limit_loop is not loop:
            self._limit_loop, self._loop_limit = loop, asyncio.Semaphore(self.max_concurrency)
        return self._loop_limit

    def _fields(self, prompts: list, columns: dict, i: int) -> dict[str, Any]:
        values = {key: columns[key][i] for key in self.fields if key in columns}
        values["prompt"] = render_text(prompts[i])
        return values

    async def _judge_one(self, session, limit, prompts, completions, columns, i) -> tuple[Optional[float], Optional[str]]:
        text = self.prompt.format(**self._fields(prompts, columns, i), completion=render_text(completions[i]))
        reply, reason = await self._ask(session, limit, text)
        if reply is None:
            return None, reason
        match = self.pattern.search(reply)
        if match is None:
            return None, f"no score: none in the reply {_clip(reply)!r}"
        return self._scaled(match.group(1) if match.groups() else match.group(0), reply)

    async def _judge_group(self, session, limit, prompts, completions, columns, rows
                           ) -> tuple[list[Optional[float]], Optional[str]]:
        numbered = "\n\n".join(f"Response {k + 1}:\n{render_text(completions[i])}" for k, i in enumerate(rows))
        text = self.prompt.format(**self._fields(prompts, columns, rows[0]), completions=numbered)
        reply, reason = await self._ask(session, limit, text)
        if reply is None:
            return [None] * len(rows), reason
        found: dict[int, str] = {}
        for match in self.pattern.finditer(reply):
            index, value = (match.group(1), match.group(2)) if len(match.groups()) >= 2 else (len(found) + 1, match.group(1))
            found.setdefault(int(index), value)
        if sorted(found) != list(range(1, len(rows) + 1)):
            return [None] * len(rows), f"no score: not one for each of the {len(rows)} responses in the reply {_clip(reply)!r}"
        scored = [self._scaled(found[k + 1], reply) for k in range(len(rows))]
        reason = next((r for _, r in scored if r is not None), None)
        return [s for s, _ in scored], reason

    def _scaled(self, text: str, reply: str) -> tuple[Optional[float], Optional[str]]:
        try:
            score = float(text)
        except ValueError:
            return None, f"no score: {text!r} is no number (reply {_clip(reply)!r})"
        if self.scale is None:
            return score, None
        low, high = self.scale
        if not low <= score <= high:
            return None, f"out of scale: the score {score:g} is outside [{low:g}, {high:g}] (reply {_clip(reply)!r})"
        return (score - low) / (high - low), None

    async def _ask(self, session, limit, text: str) -> tuple[Optional[str], Optional[str]]:
        """The judge's reply to ``text``, or ``(None, why)`` once the retries are spent."""
        import aiohttp

        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + \
            [{"role": "user", "content": text}]
        body = {"model": self.model, "messages": messages, "temperature": self.temperature, "max_tokens": self.max_tokens}
        reason = "not tried"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0))
            async with limit:
                try:
                    # no redirects: the key goes to base_url and nowhere else
                    async with session.post(f"{self.base_url}/chat/completions", json=body, allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as reply:
                        raw = await _read_bounded(reply.content, MAX_REPLY_BYTES + 1)
                        if reply.status != 200:
                            reason = f"HTTP {reply.status}: {_clip(raw.decode(errors='replace'))!r}"
                            if reply.status in RETRIED_STATUSES:
                                continue
                            return None, reason
                        if len(raw) > MAX_REPLY_BYTES:
                            return None, f"bad reply: longer than {MAX_REPLY_BYTES >> 20} MiB"
                        payload = json.loads(raw)
                except asyncio.TimeoutError:
                    reason = f"timeout: no reply within timeout_s={self.timeout_s:g}"
                    continue
                except aiohttp.ClientError as err:
                    reason = f"connection: {type(err).__name__}: {err}"
                    continue
                except ValueError:
                    return None, "bad reply: not JSON"
            try:
                return str(payload["choices"][0]["message"]["content"] or ""), None
            except (KeyError, IndexError, TypeError):
                return None, f"bad reply: no choices[0].message.content in {_clip(json.dumps(payload))!r}"
        return None, f"{reason} ({self.max_retries + 1} tries)"


async def _read_bounded(stream, limit: int) -> bytes:
    """The body, or its first ``limit`` bytes when it is longer (the rest is never read)."""
    chunks, size = [], 0
    async for chunk in stream.iter_chunked(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(chunks)[:limit]


def _groups(prompts: list) -> list[list[int]]:
    """Runs of consecutive equal prompts: the groups of responses to one prompt."""
    groups: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."

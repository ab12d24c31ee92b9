"""The regenerate job's client of OpenAI-compatible chat endpoints (SGLang, vLLM,
``transformers serve``): one answer per call, transient failures retried with backoff,
permanent ones raised with the endpoint's own words.

Transient: the connection (refused, reset, timed out) and HTTP 408, 429 and 5xx — a server
restarting or overloaded answers again later. Permanent: any other 4xx, or a 200 whose body
is not a chat completion — the same request would fail the same way. Each retry goes to the
next endpoint in the rotation, so one dead server among several costs a retry, not a row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import httpx
import tenacity

TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
ERROR_TEXT_MAX = 500  # characters of a server's error message kept in the failures file


class TransientError(Exception):
    """Worth retrying: the server may answer later."""


class PermanentError(Exception):
    """Not worth retrying: the same request fails the same way. ``str()`` is the record."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sampling:
    """The request's sampling fields; None leaves the server's default."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    thinking: bool | None = None  # chat_template_kwargs.enable_thinking, as SGLang and vLLM accept it

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p),
                                                   ("max_tokens", self.max_tokens), ("seed", self.seed))
                               if v is not None}
        if self.thinking is not None:
            out["chat_template_kwargs"] = {"enable_thinking": self.thinking}
        return out


@dataclass(frozen=True)
class Answer:
    content: str
    reasoning: str | None  # reasoning_content (SGLang, vLLM with a reasoning parser) or reasoning
    finish_reason: str | None
    output_tokens: int
    endpoint: str


@dataclass(frozen=True)
class Retry:
    """Backoff between attempts: exponential from ``initial`` seconds, capped at ``max_wait``,
    with jitter; ``attempts`` in all before a transient error becomes a failure."""

    attempts: int = 8
    initial: float = 1.0
    max_wait: float = 60.0


def base_url(endpoint: str) -> str:
    """``http://host:port`` or ``…/v1`` (with or without a trailing slash) → ``…/v1``."""
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def root_url(endpoint: str) -> str:
    """Where a server's ``/health`` lives: the endpoint without its ``/v1``."""
    return base_url(endpoint)[: -len("/v1")]


def server_words(r: httpx.Response) -> str:
    """What the server said went wrong: the message of its JSON error body — ``error.message``
    (OpenAI, vLLM), ``message`` (SGLang's ``{"object": "error", …}``) or ``detail`` (FastAPI) —
    else the body as it came; at most ERROR_TEXT_MAX characters. The message, not the envelope:
    vLLM's context-length error is a 250-character sentence inside a JSON object, and a cut
    through the object kept the escaped JSON and lost the sentence's end."""
    try:
        doc = r.json()
    except ValueError:
        doc = None
    said = None
    if isinstance(doc, dict):
        err = doc.get("error")
        said = err.get("message") if isinstance(err, dict) else err
        said = said or doc.get("message") or doc.get("detail")
    text = said if isinstance(said, str) and said.strip() else r.text
    return text[:ERROR_TEXT_MAX]


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text != type(exc).__name__ else text


class ChatClient:
    def __init__(self, endpoints: Sequence[str], model: str, sampling: Sampling, retry: Retry,
                 concurrency: int, timeout: float, api_key: str | None = None):
        self.endpoints = list(endpoints)
        self.model = model
        self.sampling = sampling
        self.retry = retry
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)), limits=limits,
                                      headers=auth_headers(api_key))
        self.requests = 0  # answered requests, for the rate
        self.retries = 0

    async def aclose(self) -> None:
        await self.http.aclose()

    async def answer(self, messages: list[dict], first_endpoint: int) -> Answer:
        """The target's answer to ``messages``; attempt k goes to endpoint first+k (mod n)."""
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.retry.attempts),
            wait=tenacity.wait_exponential_jitter(initial=self.retry.initial, max=self.retry.max_wait),
            retry=tenacity.retry_if_exception_type(TransientError),
            before_sleep=lambda _state: self._count_retry(),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    n = attempt.retry_state.attempt_number - 1
                    return await self._once(messages, self.endpoints[(first_endpoint + n) % len(self.endpoints)])
        except TransientError as exc:
            raise PermanentError(f"gave up after {self.retry.attempts} attempts: {exc}") from exc
        raise AssertionError("tenacity returned without an attempt")  # pragma: no cover

    def _count_retry(self) -> None:
        self.retries += 1

    async def _once(self, messages: list[dict], endpoint: str) -> Answer:
        body = {"model": self.model, "messages": messages, "stream": False, **self.sampling.body()}
        try:
            r = await self.http.post(base_url(endpoint) + "/chat/completions", json=body)
        except httpx.TransportError as exc:
            raise TransientError(f"{endpoint}: {_why(exc)}") from exc
        if r.status_code in TRANSIENT_STATUS:
            raise TransientError(f"{endpoint}: HTTP {r.status_code}: {server_words(r)}")
        if r.status_code != 200:
            raise PermanentError(f"{endpoint}: HTTP {r.status_code}: {server_words(r)}", r.status_code)
        try:
            doc = r.json()
            choice = doc["choices"][0]
            msg = choice["message"]
            content = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise PermanentError(f"{endpoint}: not a chat completion ({_why(exc)}): {r.text[:ERROR_TEXT_MAX]}",
                                 r.status_code) from exc
        if not isinstance(content, str):
            raise PermanentError(f"{endpoint}: message content is {type(content).__name__}, not text", r.status_code)
        self.requests += 1
        return Answer(content, reasoning if isinstance(reasoning, str) and reasoning else None,
                      choice.get("finish_reason"), tokens, endpoint)


# --------------------------------------------------------------------------- before the run


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What servers started with --api-key (SGLang, vLLM) check."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_models(endpoint: str, timeout: float = 10.0, api_key: str | None = None) -> list[str]:
    """The model ids ``GET /v1/models`` lists. Raises ValueError with one line naming the
    endpoint when it cannot be reached or is not an OpenAI-compatible server."""
    try:
        r = httpx.get(base_url(endpoint) + "/models", timeout=timeout, headers=auth_headers(api_key))
    except httpx.HTTPError as exc:
        raise ValueError(f"--endpoint {endpoint}: unreachable ({_why(exc)}); start the server or fix the URL") from exc
    if r.status_code in (401, 403):
        raise ValueError(f"--endpoint {endpoint}: GET /v1/models answered HTTP {r.status_code}: the server wants "
                         f"an API key{' other than the one given' if api_key else ''}; name the environment "
                         "variable that holds it with --api-key-env")
    if r.status_code != 200:
        raise ValueError(f"--endpoint {endpoint}: GET /v1/models answered HTTP {r.status_code}; "
                         "give the URL of an OpenAI-compatible server (SGLang, vLLM)")
    try:
        return [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--endpoint {endpoint}: GET /v1/models is not an OpenAI model list ({_why(exc)})") from exc


def healthy(endpoint: str, timeout: float = 5.0, api_key: str | None = None) -> bool:
    """The server answers ``/health`` (SGLang, vLLM, transformers serve) or, failing that, ``/v1/models``."""
    for url in (root_url(endpoint) + "/health", base_url(endpoint) + "/models"):
        try:
            if httpx.get(url, timeout=timeout, headers=auth_headers(api_key)).status_code == 200:
                return True
        except httpx.HTTPError:
            return False
    return False


def pick_model(endpoints: Sequence[str], model: str | None, api_key: str | None = None) -> str:
    """``model`` checked against what every endpoint serves, or the one model they all serve."""
    served = {e: served_models(e, api_key=api_key) for e in endpoints}
    if model:
        for e, ids in served.items():
            if model not in ids:
                raise ValueError(f"--model {model}: not served by {e} (it serves: {', '.join(ids) or 'nothing'})")
        return model
    common = set.intersection(*(set(ids) for ids in served.values()))
    if len(common) != 1:
        raise ValueError(f"--model: give the model to ask for; the endpoints serve {', '.join(sorted(common)) or 'no common model'}")
    return common.pop()

"""A scripted OpenAI-compatible chat server on 127.0.0.1, for the LLM mutator's tests.

    with LlmServer() as srv:
        srv.push(reply("..."), error(429, retry_after=7), stall(2.0), ...)
        ...  # point ModelConfig.base_url at srv.base_url
        srv.requests[0].body["messages"]

Each POST /v1/chat/completions takes the next scripted response; with the
script empty it answers 418, which the client neither retries nor treats as
fatal, so an unexpected request shows up as a rejected proposal and in
`requests`. GET /v1/models lists `models` (ids with optional fields, such as
vLLM's max_model_len); GET requests are recorded in `gets`.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclasses.dataclass(frozen=True)
class Scripted:
    """One scripted response."""

    status: int = 200
    content: str = ""
    prompt_tokens: int = 100
    completion_tokens: int = 50
    finish_reason: str = "stop"
    headers: tuple[tuple[str, str], ...] = ()
    error_message: str = ""
    delay_s: float = 0.0               # sleep before answering (a stalled endpoint)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One request the server received."""

    path: str
    headers: dict[str, str]            # lower-cased names
    body: dict[str, Any]

    @property
    def prompt(self) -> str:
        """Returns all message contents joined, for 'the prompt contains ...' checks."""
        return "\n".join(m.get("content") or "" for m in self.body.get("messages", []))


def reply(content: str, prompt_tokens: int = 100, completion_tokens: int = 50,
          finish_reason: str = "stop") -> Scripted:
    """Returns a successful completion with this text."""
    return Scripted(content=content, prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens, finish_reason=finish_reason)


def error(status: int, message: str = "scripted error", retry_after: str | None = None) -> Scripted:
    """Returns an error response in OpenAI's JSON shape."""
    headers = (("Retry-After", retry_after),) if retry_after is not None else ()
    return Scripted(status=status, error_message=message, headers=headers)


def stall(seconds: float, then: Scripted | None = None) -> Scripted:
    """Returns a response that is held back for `seconds` (past the client's timeout)."""
    base = then or reply("too late")
    return dataclasses.replace(base, delay_s=seconds)


class LlmServer:
    """A threaded HTTP server serving a queue of scripted chat completions."""

    def __init__(self, models: dict[str, dict[str, Any]] | None = None) -> None:
        self.requests: list[Recorded] = []
        self.gets: list[Recorded] = []
        self.models = dict(models or {})
        self._script: collections.deque[Scripted] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.02,), daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def push(self, *responses: Scripted) -> None:
        """Appends responses to the script."""
        with self._lock:
            self._script.extend(responses)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._script)

    def _next(self, rec: Recorded) -> Scripted:
        with self._lock:
            self.requests.append(rec)
            if self._script:
                return self._script.popleft()
        return Scripted(status=418, error_message="no scripted response left")

    def __enter__(self) -> "LlmServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()                # wakes stalled handlers
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def _handler_for(server: LlmServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:   # keep test output quiet
            pass

        def do_GET(self) -> None:
            rec = Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, {})
            with server._lock:
                server.gets.append(rec)
            if self.path.rstrip("/") != "/v1/models":
                self._send(404, {"error": {"message": f"no route {self.path}"}}, ())
                return
            data = [{"id": name, "object": "model", "created": 0, "owned_by": "test", **extra}
                    for name, extra in server.models.items()]
            self._send(200, {"object": "list", "data": data}, ())

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                body = {"_unparsed": raw.decode("utf-8", "replace")}
            rec = Recorded(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}}, ())
                return
            s = server._next(rec)
            if s.delay_s and server._stop.wait(s.delay_s):
                return                  # shutting down
            if s.status != 200:
                payload = {"error": {"message": s.error_message, "type": "scripted", "code": None}}
            else:
                payload = {
                    "id": f"chatcmpl-{len(server.requests)}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", ""),
                    "choices": [{"index": 0, "finish_reason": s.finish_reason,
                                 "message": {"role": "assistant", "content": s.content}}],
                    "usage": {"prompt_tokens": s.prompt_tokens,
                              "completion_tokens": s.completion_tokens,
                              "total_tokens": s.prompt_tokens + s.completion_tokens},
                }
            self._send(s.status, payload, s.headers)

        def _send(self, status: int, payload: dict[str, Any], headers: tuple[tuple[str, str], ...]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass                    # the client gave up (timeout): nothing to answer

    return Handler

"""The HTTP layer of ``harts serve``: the FastAPI app with Tinker's routes over a ``Service``.

Every request must carry the server's key in ``X-API-Key`` (the header the tinker SDK sends);
without it the answer is 401 and nothing else happens. Bodies are read up to
``--max-request-bytes`` (413 past it, before the rest is read). Every route is a thin call into
``Service``: a ``WireError`` becomes its status with ``{"detail": message}``; any other error is
a 500 with a one-line message while the traceback goes to the server log, and the server keeps
serving. Routes are under ``/api/v1`` as the SDK calls them.
"""

from __future__ import annotations

import hmac
import json
import logging
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from harts.errors import UserError
from harts.serve.service import Service
from harts.serve.wire import WireError

__all__ = ["build_app"]

log = logging.getLogger("harts.serve")

Handler = Callable[[Request], Awaitable[Any]]


class _Guard:
    """ASGI middleware: the API key check and the request size limit, before any route runs."""

    def __init__(self, app: ASGIApp, api_key: str, max_bytes: int) -> None:
        self.app = app
        self.key = api_key.encode()
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if not hmac.compare_digest(headers.get("x-api-key", b""), self.key):
            detail = "missing or wrong API key: send the server's key in the X-API-Key header"
            await _send(send, 401, {"detail": detail})
            return
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _send(send, 413, {"detail": f"the request body is over {self.max_bytes} bytes (--max-request-bytes)"})
            return
        await self.app(scope, receive, send)


async def _send(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused past ``limit`` bytes (for bodies sent without a length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise WireError(f"the request body is over {limit} bytes (--max-request-bytes)", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _answer(result: Any) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, tuple):
        body, media_type = result
        return Response(content=body, media_type=media_type)
    return JSONResponse(result)


def _int_query(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise WireError(f"{name}: {raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise WireError(f"{name}: {value}; between {lo} and {hi}")
    return value


def _no_args(fn: Callable[[], Any]) -> Handler:
    """A route handler that needs nothing from the request."""

    async def handler(request: Request) -> Any:
        return fn()

    return handler


def build_app(service: Service) -> FastAPI:
    """The FastAPI app serving ``service`` (module docstring)."""
    config = service.config
    app = FastAPI(title="harts serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, api_key=config.api_key, max_bytes=config.max_request_bytes)

    def route(method: str, path: str, fn: Handler) -> None:
        async def endpoint(request: Request) -> Response:
            try:
                return _answer(await fn(request))
            except WireError as err:
                return JSONResponse({"detail": str(err)}, status_code=err.status)
            except UserError as err:
                return JSONResponse({"detail": str(err)}, status_code=400)
            except Exception as err:  # a bug of ours: one line to the client, the traceback to the log
                log.error("%s %s failed:\n%s", method, request.url.path, traceback.format_exc())
                line = (str(err).strip().splitlines() or [""])[0]
                return JSONResponse({"detail": f"internal error: {type(err).__name__}: {line}"}, status_code=500)

        app.add_api_route(f"/api/v1/{path}", endpoint, methods=[method], include_in_schema=False)

    async def body(request: Request) -> bytes:
        return await _body(request, config.max_request_bytes)

    async def ok(request: Request) -> Any:
        return {"status": "ok"}

    async def dynamic_config(request: Request) -> Any:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    async def telemetry(request: Request) -> Any:
        await body(request)  # read and dropped: the server keeps no client telemetry
        return {"status": "accepted"}

    async def forward_backward(request: Request) -> Any:
        return service.forward_backward(await body(request), request.headers.get("content-encoding"))

    async def retrieve(request: Request) -> Any:
        return await service.retrieve(await body(request))

    def post(fn: Callable[[bytes], Any]) -> Handler:
        async def handler(request: Request) -> Any:
            return fn(await body(request))

        return handler

    def path_arg(fn: Callable[..., Any], *names: str) -> Handler:
        async def handler(request: Request) -> Any:
            return fn(*(request.path_params[n] for n in names))

        return handler

    def paged(fn: Callable[[int, int], Any]) -> Handler:
        async def handler(request: Request) -> Any:
            limit = _int_query(request, "limit", 20, 1, 10_000)
            return fn(limit, _int_query(request, "offset", 0, 0, 1 << 31))

        return handler

    route("GET", "healthz", ok)
    route("POST", "client/config", post(lambda _: service.client_config()))
    route("POST", "client/dynamic_config", dynamic_config)
    route("GET", "get_server_capabilities", _no_args(service.capabilities))
    route("POST", "create_session", post(service.create_session))
    route("POST", "session_heartbeat", post(service.heartbeat))
    route("POST", "sessions/{session_id}/finish", path_arg(service.finish_session, "session_id"))
    route("GET", "sessions/{session_id}", path_arg(service.get_session, "session_id"))
    route("GET", "sessions", _no_args(service.list_sessions))
    route("POST", "telemetry", telemetry)
    route("POST", "create_model", post(service.create_model))
    route("POST", "get_info", post(service.get_info))
    route("POST", "forward_backward", forward_backward)
    route("POST", "optim_step", post(service.optim_step))
    route("POST", "save_weights", post(service.save_weights))
    route("POST", "save_weights_for_sampler", post(service.save_weights_for_sampler))
    route("POST", "load_weights", post(service.load_weights))
    route("POST", "create_sampling_session", post(service.create_sampling_session))
    route("GET", "samplers/{sampler_id}", path_arg(service.get_sampler, "sampler_id"))
    route("POST", "asample", post(service.asample))
    route("POST", "retrieve_future", retrieve)
    route("GET", "training_runs", paged(service.training_runs))
    route("GET", "training_runs/{model_id}", path_arg(service.training_run, "model_id"))
    route("GET", "training_runs/{model_id}/checkpoints", path_arg(service.list_checkpoints, "model_id"))
    route(
        "DELETE",
        "training_runs/{model_id}/checkpoints/{checkpoint_id:path}",
        path_arg(service.delete_checkpoint, "model_id", "checkpoint_id"),
    )
    route("GET", "checkpoints", paged(service.user_checkpoints))
    route("POST", "weights_info", post(service.weights_info))
    return app

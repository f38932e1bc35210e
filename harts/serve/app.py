"""The HTTP layer of ``harts serve``: the FastAPI app with Tinker's routes over a ``Service``.

Every request must carry one of the server's keys in ``X-API-Key`` (the header the tinker SDK
sends); without one the answer is 401 and nothing else happens. The key's tenant is passed to
every ``Service`` method that touches a session, run, sampling client, request or checkpoint,
and the service answers 404 for another tenant's (``harts.serve.tenants``). Bodies are read up to
``--max-request-bytes`` (413 past it, before the rest is read); JSON bodies (every route but
``forward_backward``) only up to ``ServeConfig.max_json_bytes``, and a body that stalls for
``--body-timeout`` seconds gets 408 (both close the connection). Every route is a thin call into
``Service``, made on the thread pool once the body is read: parsing and checking a large request
takes its time there while the event loop goes on answering everyone else (``/healthz``, other
clients' polls). A ``WireError`` becomes its status with ``{"detail": message}``; any other error
is a 500 with a one-line message while the traceback goes to the server log, and the server keeps
serving. Routes are under ``/api/v1`` as the SDK calls them; ``cancel_future`` is the SDK's
cancel of an abandoned sampling future (``client/dynamic_config`` turns it on). A route the server
does not serve is a 404 naming it (``Service.unserved``, which gives a training client's sequence
number back), never a 405 or a hang. The signed URLs of ``get_external_weights_urls`` (under
``/api/v1/download/``) are the one thing answered without a key: each carries its own signature
(``harts.serve.access``); their files, and checkpoint archives, stream from disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tarfile
import traceback
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from harts.errors import UserError
from harts.serve.service import Service
from harts.serve.tenants import Keys
from harts.serve.wire import WireError

__all__ = ["build_app"]

log = logging.getLogger("harts.serve")

Handler = Callable[[Request], Awaitable[Any]]

#: the ASGI scope entry holding the tenant of the request's key (set by ``_Guard``)
TENANT = "harts.tenant"
#: where the signed URLs of ``get_external_weights_urls`` point: fetched without a key
DOWNLOAD = "/api/v1/download/"


class _Guard:
    """ASGI middleware: the API key check and the request size limit, before any route runs. The
    key's tenant goes into the scope (``TENANT``), where every route reads whose request it is."""

    def __init__(self, app: ASGIApp, keys: Keys, max_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if scope["method"] in ("GET", "HEAD") and scope["path"].startswith(DOWNLOAD):
            await self.app(scope, receive, send)  # a signed URL: the route checks its signature
            return
        tenant = self.keys.tenant(headers.get("x-api-key", b""))
        if tenant is None:
            detail = "missing or wrong API key: send the server's key in the X-API-Key header"
            await _send(send, 401, {"detail": detail})
            return
        scope[TENANT] = tenant
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await _send(send, 413, {"detail": f"the request body is over {self.max_bytes} bytes (--max-request-bytes)"})
            return
        await self.app(scope, receive, send)


async def _send(send: Send, status: int, body: dict[str, Any]) -> None:
    """Answer ``status`` with the JSON ``body``, closing the connection after a status of ``_CLOSING``."""
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    if status in _CLOSING:  # uvicorn closes it then, instead of reading a body nobody wants
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


#: statuses answered with ``Connection: close``: the client may still be sending a body nobody reads
_CLOSING = (408, 413)


async def _body(request: Request, limit: int, timeout: float, what: str = "--max-request-bytes") -> bytes:
    """The request body, refused past ``limit`` bytes (for bodies sent without a length; ``what``
    names the limit), and when nothing of it arrives for ``timeout`` seconds (a half-sent body
    would otherwise hold its connection and task for good)."""
    chunks: list[bytes] = []
    size = 0
    stream = request.stream()
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), timeout)
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            raise WireError(f"the request body stalled: nothing came for {timeout:g} s (--body-timeout)", 408) from None
        size += len(chunk)
        if size > limit:
            raise WireError(f"the request body is over {limit} bytes ({what})", 413)
        chunks.append(chunk)


def tar_stream(top: str, files: dict[str, Path], chunk: int = 1 << 20) -> Iterator[bytes]:
    """A POSIX tar of ``files`` (path in the archive under ``top/`` -> file on disk), produced a
    piece at a time: headers from ``tarfile``, each file read in ``chunk``-byte pieces, so a
    checkpoint of any size streams in constant memory. A file that changes size while it is
    read (a concurrent overwrite) ends the stream with an error rather than a corrupt member."""
    for name, path in files.items():
        with open(path, "rb") as f:
            info = tarfile.TarInfo(f"{top}/{name}")
            stat = os.fstat(f.fileno())
            info.size, info.mtime, info.mode = stat.st_size, int(stat.st_mtime), 0o644
            yield info.tobuf(format=tarfile.PAX_FORMAT)
            left = info.size
            while left > 0:
                piece = f.read(min(chunk, left))
                if not piece:
                    raise OSError(f"{path} shrank while it was archived")
                left -= len(piece)
                yield piece
            if info.size % tarfile.BLOCKSIZE:
                yield bytes(tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield bytes(2 * tarfile.BLOCKSIZE)


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


def _tenant(request: Request) -> str:
    """The tenant of the request's key (``_Guard`` put it in the scope)."""
    return str(request.scope[TENANT])


def _no_args(fn: Callable[[], Any]) -> Handler:
    """A route handler that needs nothing from the request."""

    async def handler(request: Request) -> Any:
        return fn()

    return handler


def build_app(service: Service) -> FastAPI:
    """The FastAPI app serving ``service`` (module docstring)."""
    config = service.config
    app = FastAPI(title="harts serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, keys=Keys(config.keys), max_bytes=config.max_request_bytes)

    route = _router(app)

    async def body(request: Request) -> bytes:
        return await _body(request, config.max_request_bytes, config.body_timeout)

    async def json_body(request: Request) -> bytes:
        what = "the most a JSON request takes here, a sampling prompt of --capacity tokens and more"
        return await _body(request, config.max_json_bytes, config.body_timeout, what)

    async def ok(request: Request) -> Any:
        return {"status": "ok"}

    async def dynamic_config(request: Request) -> Any:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True, "sample_cancel_max_batch_size": 64}

    async def telemetry(request: Request) -> Any:
        await json_body(request)  # read and dropped: the server keeps no client telemetry
        return {"status": "accepted"}

    async def forward_backward(request: Request) -> Any:
        data, encoding = await body(request), request.headers.get("content-encoding")
        return await run_in_threadpool(service.forward_backward, _tenant(request), data, encoding)

    async def retrieve(request: Request) -> Any:
        return await service.retrieve(_tenant(request), await json_body(request))

    def post(fn: Callable[[str, bytes], Any]) -> Handler:
        async def handler(request: Request) -> Any:
            data = await json_body(request)
            return await run_in_threadpool(fn, _tenant(request), data)

        return handler

    def path_arg(fn: Callable[..., Any], *names: str) -> Handler:
        async def handler(request: Request) -> Any:
            return await run_in_threadpool(fn, _tenant(request), *(request.path_params[n] for n in names))

        return handler

    def paged(fn: Callable[[str, int, int], Any]) -> Handler:
        async def handler(request: Request) -> Any:
            limit = _int_query(request, "limit", 20, 1, 10_000)
            return await run_in_threadpool(fn, _tenant(request), limit, _int_query(request, "offset", 0, 0, 1 << 31))

        return handler

    route("GET", "healthz", ok)
    route("POST", "client/config", post(lambda _tenant, _body: service.client_config()))
    route("POST", "client/dynamic_config", dynamic_config)
    route("GET", "get_server_capabilities", _no_args(service.capabilities))
    route("POST", "create_session", post(service.create_session))
    route("POST", "session_heartbeat", post(service.heartbeat))
    route("POST", "sessions/{session_id}/finish", path_arg(service.finish_session, "session_id"))
    route("GET", "sessions/{session_id}", path_arg(service.get_session, "session_id"))
    route("GET", "sessions", path_arg(service.list_sessions))
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
    route("POST", "cancel_future", post(service.cancel_future))
    route("GET", "training_runs", paged(service.training_runs))
    route("GET", "training_runs/{model_id}", path_arg(service.training_run, "model_id"))
    route("GET", "checkpoints", paged(service.user_checkpoints))
    route("POST", "weights_info", post(service.weights_info))
    route("POST", "save_weights_external", post(service.save_weights_external))
    _weights_out_routes(route, service, json_body)
    # after the checkpoint routes above: a DELETE of ``<checkpoint>/publish`` (unpublish) would
    # otherwise match the delete route with ``<kind>/<name>/publish`` as the checkpoint id
    route("GET", "training_runs/{model_id}/checkpoints", path_arg(service.list_checkpoints, "model_id"))
    route(
        "DELETE",
        "training_runs/{model_id}/checkpoints/{checkpoint_id:path}",
        path_arg(service.delete_checkpoint, "model_id", "checkpoint_id"),
    )

    async def unserved(request: Request) -> Any:
        data = await json_body(request)
        path = request.path_params["rest"]
        return await run_in_threadpool(service.unserved, _tenant(request), request.method, path, data)

    # after every route it serves: the rest is refused, its sequence number freed (Service.unserved)
    for method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"):
        route(method, "{rest:path}", unserved)
    return app


def _router(app: FastAPI) -> Callable[[str, str, Handler], None]:
    """``route(method, path, handler)``: ``handler``'s answer under ``/api/v1/<path>``; a
    ``WireError`` its status (closing the connection where ``_CLOSING`` says), a ``UserError`` a
    400, any other exception a 500 with one line (the traceback to the log)."""

    def route(method: str, path: str, fn: Handler) -> None:
        async def endpoint(request: Request) -> Response:
            try:
                return _answer(await fn(request))
            except WireError as err:
                close = {"connection": "close"} if err.status in _CLOSING else None
                return JSONResponse({"detail": str(err)}, status_code=err.status, headers=close)
            except UserError as err:
                return JSONResponse({"detail": str(err)}, status_code=400)
            except Exception as err:  # a bug of ours: one line to the client, the traceback to the log
                log.error("%s %s failed:\n%s", method, request.url.path, traceback.format_exc())
                line = (str(err).strip().splitlines() or [""])[0]
                return JSONResponse({"detail": f"internal error: {type(err).__name__}: {line}"}, status_code=500)

        app.add_api_route(f"/api/v1/{path}", endpoint, methods=[method], include_in_schema=False)

    return route


def _weights_out_routes(
    route: Callable[[str, str, Handler], None], service: Service, json_body: Callable[[Request], Any]
) -> None:
    """The routes that get weights out and set who may: signed download URLs, the archive,
    publish / unpublish and TTL (``service.access``)."""
    checkpoint = "training_runs/{model_id}/checkpoints/{kind}/{name}"

    def checkpoint_id(request: Request) -> tuple[str, str]:
        p = request.path_params
        return p["model_id"], f"{p['kind']}/{p['name']}"

    def of_checkpoint(fn: Callable[[str, str, str], Any]) -> Handler:
        async def handler(request: Request) -> Any:
            return await run_in_threadpool(fn, _tenant(request), *checkpoint_id(request))

        return handler

    async def urls(request: Request) -> Any:
        base = str(request.base_url)
        return await run_in_threadpool(
            service.access.external_weights_urls, _tenant(request), *checkpoint_id(request), base
        )

    async def ttl(request: Request) -> Any:
        data = await json_body(request)
        return await run_in_threadpool(service.access.set_ttl, _tenant(request), *checkpoint_id(request), data)

    async def download(request: Request) -> Any:
        q = request.query_params
        route = "download/" + request.path_params["route"]
        path = await run_in_threadpool(service.access.download, route, q.get("expires"), q.get("signature"))
        # streamed from the file in chunks, never read whole
        return FileResponse(path, media_type="application/octet-stream")

    async def archive(request: Request) -> Any:
        top, files = await run_in_threadpool(service.access.archive, _tenant(request), *checkpoint_id(request))
        headers = {"content-disposition": f'attachment; filename="{top}.tar"'}
        return StreamingResponse(
            iterate_in_threadpool(tar_stream(top, files)), media_type="application/x-tar", headers=headers
        )

    route("GET", f"{checkpoint}/external_weights_urls", urls)
    route("POST", f"{checkpoint}/publish", of_checkpoint(service.access.publish))
    route("DELETE", f"{checkpoint}/publish", of_checkpoint(service.access.unpublish))
    route("PUT", f"{checkpoint}/ttl", ttl)
    route("GET", f"{checkpoint}/archive", archive)
    route("GET", "download/{route:path}", download)
    route("HEAD", "download/{route:path}", download)

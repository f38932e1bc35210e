"""What leaves ``harts serve`` besides training results: checkpoints read by other tenants
(published), deleted when their TTL runs out, and downloaded.

``CheckpointAccess`` answers the SDK's ``publish`` / ``unpublish`` / ``ttl`` routes,
``get_external_weights_urls`` and the files its signed URLs name, and the ``archive`` route (any
checkpoint as one tar, with the key). Who owns a run is the ``Service``'s to say (``owns``); a
tenant may read a checkpoint it owns or one its owner published, and only the owner publishes,
sets a TTL or deletes. A download URL carries its own proof: an HMAC-SHA256 of its route and
expiry under the signing tenant's key, so it needs no key header, names one file, and stops
working when it expires, when the checkpoint is gone, or when the signer may no longer read it.
``public`` and ``expires_at`` are fields of the checkpoint's metadata file (``CheckpointDir``),
written aside and renamed into place, so they survive a restart; the ``Service``'s reaper calls
``expire`` to delete checkpoints whose TTL ran out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from tinker import types

from harts.serve.checkpoints import CheckpointDir, now
from harts.serve.wire import TinkerPath, WireError, json_body, parse_tinker_path

__all__ = ["TTL_RANGE", "URL_SECONDS", "CheckpointAccess", "check_ttl"]

log = logging.getLogger("harts.serve")

#: Tinker's range of a checkpoint's ``ttl_seconds``: one hour to ten years
TTL_RANGE = (3600, 10 * 365 * 24 * 3600)
#: how long the URLs of ``get_external_weights_urls`` stay valid
URL_SECONDS = 3600


def check_ttl(ttl: int | None) -> None:
    """A 400 naming ``ttl_seconds`` outside ``TTL_RANGE`` (None: no TTL)."""
    if ttl is not None and not TTL_RANGE[0] <= ttl <= TTL_RANGE[1]:
        raise WireError(
            f"ttl_seconds: {ttl}; between {TTL_RANGE[0]} (one hour) and {TTL_RANGE[1]} (ten years), or none"
        )


def _sign(key: str, route: str, expires: int) -> str:
    """The signature of a download URL: HMAC-SHA256 of its route and expiry under a tenant's key."""
    return hmac.new(key.encode(), f"{route}\n{expires}".encode(), hashlib.sha256).hexdigest()


#: ``owns(tenant, model_id, record)``: True when training run ``model_id`` is ``tenant``'s
#: (``record``: its ``run.json`` when already read, else None)
Owns = Callable[[str, str, "dict[str, Any] | None"], bool]


class CheckpointAccess:
    """Publishing, TTLs and downloads of the checkpoints under one state directory (module
    docstring). ``lock`` orders them with deletions: two of one checkpoint at once are one
    after the other, not a race."""

    def __init__(self, checkpoints: CheckpointDir, owns: Owns, keys: dict[str, str]) -> None:
        self.checkpoints = checkpoints
        self._owns = owns
        #: tenant -> key: what download URLs are signed with
        self._keys = dict(keys)
        self.lock = threading.Lock()

    def owned(self, tenant: str, model_id: str, checkpoint_id: str) -> TinkerPath:
        """Checkpoint ``<kind>/<name>`` of ``tenant``'s run ``model_id``, on disk (404 otherwise)."""
        tp = parse_tinker_path(f"tinker://{model_id}/{checkpoint_id}", "checkpoint_id")
        if not self._owns(tenant, tp.model_id, None) or not self.checkpoints.exists(tp):
            raise WireError(f"checkpoint {tp} does not exist", 404)
        return tp

    def readable(self, tenant: str, tp: TinkerPath, record: dict[str, Any] | None = None) -> bool:
        """True when ``tenant`` may read checkpoint ``tp`` (sample, load, download it): its own, or
        one its owner published. Publishing, TTLs and deletion stay with the owner."""
        if self._owns(tenant, tp.model_id, record):
            return True
        return (
            self.checkpoints.read_run(tp.model_id) is not None and self.checkpoints.metadata(tp).get("public") is True
        )

    def publish(self, tenant: str, model_id: str, checkpoint_id: str) -> dict[str, Any]:
        """``publish_checkpoint_from_tinker_path``: every tenant of the server may read it now.
        One already public is a 400 (the SDK retries a 409, Tinker's answer, for minutes)."""
        return self._set_public(tenant, model_id, checkpoint_id, True)

    def unpublish(self, tenant: str, model_id: str, checkpoint_id: str) -> dict[str, Any]:
        """``unpublish_checkpoint_from_tinker_path``: only its owner reads it again."""
        return self._set_public(tenant, model_id, checkpoint_id, False)

    def _set_public(self, tenant: str, model_id: str, checkpoint_id: str, public: bool) -> dict[str, Any]:
        with self.lock:
            tp = self.owned(tenant, model_id, checkpoint_id)
            if self.checkpoints.metadata(tp).get("public", False) == public:
                raise WireError(f"checkpoint {tp} is {'already public' if public else 'not public'}")
            self.checkpoints.update(tp, public=public)
        log.info("checkpoint %s %s", tp, "published" if public else "unpublished")
        return {}

    def set_ttl(self, tenant: str, model_id: str, checkpoint_id: str, body: bytes) -> dict[str, Any]:
        """``set_checkpoint_ttl_from_tinker_path``: the checkpoint is deleted ``ttl_seconds`` from
        now (None: never); the reaper deletes expired checkpoints within ``_reap``'s period."""
        data = json_body(body, "ttl")
        ttl = data.get("ttl_seconds")
        if ttl is not None and (type(ttl) is not int):
            raise WireError(f"ttl_seconds: {ttl!r}; an integer number of seconds or null")
        check_ttl(ttl)
        with self.lock:
            tp = self.owned(tenant, model_id, checkpoint_id)
            expires = None if ttl is None else (now() + timedelta(seconds=ttl)).isoformat()
            self.checkpoints.update(tp, expires_at=expires)
        return {}

    def expire(self, at: datetime | None = None) -> list[str]:
        """Delete every checkpoint whose TTL ran out by ``at`` (None: now); the paths deleted."""
        gone = []
        with self.lock:
            for tp in self.checkpoints.expired(now() if at is None else at):
                try:
                    self.checkpoints.delete(tp)
                except WireError:  # deleted meanwhile
                    continue
                log.info("checkpoint %s deleted: its ttl_seconds ran out", tp)
                gone.append(str(tp))
        return gone

    def external_weights_urls(self, tenant: str, model_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        """``get_external_weights_urls``: one signed URL per file of an ``external_weights``
        checkpoint ``tenant`` may read, valid for ``URL_SECONDS``; ``base_url`` is the server's
        address as the client reached it. The signature is an HMAC of the URL's path and expiry
        under the tenant's key, so a URL works without the key, for its files only, until it
        expires (or the checkpoint is deleted or unpublished)."""
        tp = parse_tinker_path(f"tinker://{model_id}/{checkpoint_id}", "checkpoint_id", kinds=("external_weights",))
        if not self.readable(tenant, tp) or not self.checkpoints.exists(tp):
            raise WireError(f"checkpoint {tp} does not exist", 404)
        expires = int(time.time()) + URL_SECONDS
        urls = {}
        for name in self.checkpoints.files(tp):
            route = f"download/{tenant}/{tp.model_id}/{tp.kind}/{tp.name}/{name}"
            signature = _sign(self._keys[tenant], route, expires)
            query = urllib.parse.urlencode({"expires": expires, "signature": signature})
            urls[name] = f"{base_url.rstrip('/')}/api/v1/{urllib.parse.quote(route, safe='/:')}?{query}"
        return types.ExternalWeightsUrlsResponse(
            urls=urls, expires=datetime.fromtimestamp(expires, timezone.utc)
        ).model_dump(mode="json")

    def download(self, route: str, expires: str | None, signature: str | None) -> Path:
        """The file a signed URL of ``external_weights_urls`` names (``route``: its path after
        ``/api/v1/``); 403 for a signature that does not match or has expired, 404 for a file that
        is gone or no longer readable by the signer."""
        parts = route.split("/", 5)
        if len(parts) != 6 or parts[0] != "download" or expires is None or signature is None:
            raise WireError("download: not a download URL of this server", 404)
        _, tenant, model_id, kind, name, file = parts
        key = self._keys.get(tenant)
        if key is None or not expires.isdigit() or not hmac.compare_digest(_sign(key, route, int(expires)), signature):
            raise WireError("download: the URL's signature does not match; get new URLs", 403)
        if int(expires) < time.time():
            raise WireError("download: the URL has expired; get new URLs with get_external_weights_urls", 403)
        tp = parse_tinker_path(f"tinker://{model_id}/{kind}/{name}", "download", kinds=("external_weights",))
        if not self.readable(tenant, tp) or not self.checkpoints.exists(tp):
            raise WireError(f"download: checkpoint {tp} does not exist", 404)
        path = self.checkpoints.files(tp).get(file)
        if path is None:
            raise WireError(f"download: checkpoint {tp} has no file {file!r}", 404)
        return path

    def archive(self, tenant: str, model_id: str, checkpoint_id: str) -> tuple[str, dict[str, Path]]:
        """(the archive's folder name, its files by path) of a checkpoint of any kind ``tenant``
        may read, for ``GET .../archive``: one tar of it, streamed as it is read."""
        tp = parse_tinker_path(f"tinker://{model_id}/{checkpoint_id}", "checkpoint_id")
        if not self.readable(tenant, tp) or not self.checkpoints.exists(tp):
            raise WireError(f"checkpoint {tp} does not exist", 404)
        return f"{tp.model_id}_{tp.kind}_{tp.name}".replace(":", "_"), self.checkpoints.files(tp)

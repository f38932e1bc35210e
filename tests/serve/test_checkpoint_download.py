"""Weights out of ``harts serve``: ``save_weights_external`` writes the weights in transformers'
layout, ``get_external_weights_urls`` signs one URL per file, ``tinker checkpoint download`` (the
SDK's own CLI, unchanged) fetches a training or an external checkpoint through them, and publish /
unpublish / TTL behave as the SDK documents them. A URL works without the key, for its file only,
until it expires; another tenant gets no URLs for a checkpoint that is not published.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")

from tinker import types  # noqa: E402

from tests.serve._server import Server, serving  # noqa: E402

ALICE = "tml-alice-0123456789abcdef"
BOB = "tml-bob-fedcba9876543210"
KEYS_TOML = f'[tenants.alice]\nkey = "{ALICE}"\n\n[tenants.bob]\nkey = "{BOB}"\n'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    workdir = tmp_path_factory.mktemp("serve download")
    keys = workdir / "keys.toml"
    keys.write_text(KEYS_TOML)
    with serving("tiny", workdir, "--capacity", "256", "--max-models", "8", keys_file=keys, key=ALICE) as srv:
        yield srv


@pytest.fixture(scope="module")
def trained(server: Server) -> Iterator[Any]:
    """Alice's training client after one step."""
    service = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
    tc = service.create_lora_training_client(base_model="tiny", rank=2, seed=3).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [0.0, 1.0, 1.0, 1.0]},
    )
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    yield tc
    service.close("success").result()


def rest(server: Server, key: str = ALICE) -> Any:
    return tinker.RestClient(base_url=server.url, api_key=key)


def digest(root: Path) -> dict[str, str]:
    """File path under ``root`` -> sha256 of its bytes."""
    return {
        f.relative_to(root).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(root.rglob("*"))
        if f.is_file()
    }


def folder(server: Server, tinker_path: str) -> Path:
    model_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return server.state_dir / "runs" / model_id / kind / name


def cli_download(server: Server, tinker_path: str, out: Path, key: str = ALICE) -> subprocess.CompletedProcess:
    """``tinker checkpoint download`` as a user runs it, pointed at the server by its environment."""
    env = dict(os.environ, TINKER_BASE_URL=server.url, TINKER_API_KEY=key, TINKER_TELEMETRY="0")
    cmd = [sys.executable, "-m", "tinker.cli", "checkpoint", "download", tinker_path, "--output", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_external_weights_download_byte_for_byte(server: Server, trained: Any, tmp_path: Path) -> None:
    path = trained.save_weights_external("export").result().path
    assert path == f"tinker://{trained.model_id}/external_weights/export"
    saved = digest(folder(server, path))
    assert "config.json" in saved or any(name.endswith(".json") for name in saved), saved
    urls = rest(server).get_external_weights_urls(path).result()
    assert sorted(urls.urls) == sorted(saved)
    assert urls.expires > datetime.now(timezone.utc) + timedelta(minutes=50)
    # a signed URL needs no key
    name = sorted(urls.urls)[0]
    with urllib.request.urlopen(urls.urls[name], timeout=60) as r:
        assert hashlib.sha256(r.read()).hexdigest() == saved[name]
    done = cli_download(server, path, tmp_path)
    assert done.returncode == 0, done.stderr
    assert digest(tmp_path / path.removeprefix("tinker://").replace("/", "_")) == saved


def test_training_checkpoint_download_goes_through_a_temporary_export(
    server: Server, trained: Any, tmp_path: Path
) -> None:
    """The CLI loads the state into a new run, exports it, signs, renews its TTL, downloads and
    deletes the export: every one of those calls must answer."""
    state = trained.save_state("for-download").result().path
    sampler = trained.save_weights_for_sampler("same-weights").result().path
    done = cli_download(server, state, tmp_path)
    assert done.returncode == 0, done.stderr
    got = digest(tmp_path / state.removeprefix("tinker://").replace("/", "_"))
    # the export is the sampler's weights of the same state (transformers' layout, adapters merged)
    assert got == digest(folder(server, sampler))
    # the temporary export was deleted afterwards
    left = [c.tinker_path for c in rest(server).list_user_checkpoints(limit=1000).result().checkpoints]
    assert not [p for p in left if p.endswith("/external_weights/download")], left


def test_signed_urls_are_bound_to_their_file_and_time(server: Server, trained: Any) -> None:
    path = trained.save_weights_external("signed").result().path
    urls = rest(server).get_external_weights_urls(path).result().urls
    first, second = sorted(urls)[:2] if len(urls) > 1 else (sorted(urls)[0], sorted(urls)[0])
    tampered = [
        urls[first].replace("signature=", "signature=0"),
        urls[first].replace("expires=", "expires=9"),
        urls[first].split("?")[0] + "?" + urls[second].split("?")[1] if first != second else urls[first] + "0",
    ]
    for url in tampered:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=60)
        assert err.value.code in (403, 404), url


def test_another_tenant_gets_no_urls_until_published(server: Server, trained: Any) -> None:
    path = trained.save_weights_external("shared").result().path
    with pytest.raises(tinker.NotFoundError):
        rest(server, BOB).get_external_weights_urls(path).result()
    rest(server).publish_checkpoint_from_tinker_path(path).result()
    listed = {c.tinker_path: c for c in rest(server).list_checkpoints(trained.model_id).result().checkpoints}
    assert listed[path].public
    urls = rest(server, BOB).get_external_weights_urls(path).result().urls
    name = sorted(urls)[0]
    with urllib.request.urlopen(urls[name], timeout=60) as r:
        assert r.read() == (folder(server, path) / name).read_bytes()
    # unpublish is not a delete: the checkpoint stays, private again, and bob's URLs stop working
    rest(server).unpublish_checkpoint_from_tinker_path(path).result()
    assert folder(server, path).is_dir()
    listed = {c.tinker_path: c for c in rest(server).list_checkpoints(trained.model_id).result().checkpoints}
    assert not listed[path].public
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urls[name], timeout=60)
    assert err.value.code == 404
    # only the owner publishes, sets a TTL, deletes
    bob = rest(server, BOB)
    for call in (
        lambda: bob.publish_checkpoint_from_tinker_path(path),
        lambda: bob.unpublish_checkpoint_from_tinker_path(path),
        lambda: bob.set_checkpoint_ttl_from_tinker_path(path, 7200),
        lambda: bob.delete_checkpoint_from_tinker_path(path),
    ):
        with pytest.raises(tinker.NotFoundError):
            call().result()
    assert folder(server, path).is_dir()


def test_ttl_is_recorded_checked_and_removable(server: Server, trained: Any) -> None:
    path = trained.save_state("ttl", ttl_seconds=7200).result().path
    client = rest(server)

    def expires() -> datetime | None:
        listed = {c.tinker_path: c for c in client.list_checkpoints(trained.model_id).result().checkpoints}
        return listed[path].expires_at

    first = expires()
    assert first is not None and timedelta(minutes=110) < first - datetime.now(timezone.utc) < timedelta(minutes=121)
    client.set_checkpoint_ttl_from_tinker_path(path, 86400).result()
    later = expires()
    assert later is not None and later - first > timedelta(hours=20)
    client.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert expires() is None
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        client.set_checkpoint_ttl_from_tinker_path(path, 10).result()


def test_an_expired_checkpoint_is_deleted_and_flags_survive_a_restart(tmp_path: Path) -> None:
    """In process: the reaper's ``CheckpointAccess.expire`` deletes a checkpoint once its TTL ran out
    (not before), and ``public`` / ``expires_at`` are read back from disk by a new server."""
    from harts.serve.config import ServeConfig
    from harts.serve.server import make_service
    from harts.serve.wire import TinkerPath

    config = ServeConfig(model="tiny", api_key=ALICE, state_dir=tmp_path, capacity=256)
    service = make_service(config)
    try:
        record = {"base_model": "tiny", "created": datetime.now(timezone.utc).isoformat(), "tenant": "default"}
        service.checkpoints.write_run("s:train:0", record)
        short, kept = TinkerPath("s:train:0", "weights", "short"), TinkerPath("s:train:0", "weights", "kept")
        for tp in (short, kept):
            service.checkpoints.save(tp, lambda d: (d.mkdir(), (d / "w.bin").write_bytes(b"x")), overwrite=False)
        service.access.set_ttl("default", "s:train:0", "weights/short", b'{"ttl_seconds": 3600}')
        service.access.publish("default", "s:train:0", "weights/kept")
        now = datetime.now(timezone.utc)
        assert service.access.expire(now + timedelta(minutes=59)) == []
        assert service.access.expire(now + timedelta(minutes=61)) == [str(short)]
        assert not service.checkpoints.exists(short) and service.checkpoints.exists(kept)
    finally:
        service.close()
    again = make_service(config)
    try:
        (listed,) = again.checkpoints.listing("s:train:0")
        assert listed["tinker_path"] == str(kept) and listed["public"] is True and listed["expires_at"] is None
    finally:
        again.close()


def test_any_checkpoint_streams_as_one_tar(server: Server, trained: Any) -> None:
    """``GET .../archive`` with the key: the checkpoint (here a training state, optimizer and all)
    as one tar, streamed; another tenant's key gets 404, no key 401."""
    import io
    import tarfile

    import httpx

    state = trained.save_state("archived").result().path
    model_id, _, name = state.removeprefix("tinker://").split("/")
    url = f"{server.url}/api/v1/training_runs/{model_id}/checkpoints/weights/{name}/archive"
    with httpx.stream("GET", url, headers={"X-API-Key": ALICE}, timeout=60) as r:
        assert r.status_code == 200 and "content-length" not in r.headers, r.headers
        data = b"".join(r.iter_bytes())
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        got = {}
        for member in tar.getmembers():
            top, _, inner = member.name.partition("/")
            assert top == f"{model_id}_weights_{name}".replace(":", "_") and member.isfile(), member.name
            got[inner] = hashlib.sha256(tar.extractfile(member).read()).hexdigest()  # type: ignore[union-attr]
    assert got == digest(folder(server, state))
    assert httpx.get(url, headers={"X-API-Key": BOB}, timeout=60).status_code == 404
    assert httpx.get(url, timeout=60).status_code == 401

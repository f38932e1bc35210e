"""What each Tinker endpoint does, independent of HTTP: validate, register, queue.

``Service`` holds the server's Tinker-side state -- sessions, training runs, sampling clients --
and one method per endpoint. A method validates its request completely (``WireError`` naming the
field, before any work is queued), then either answers at once (sessions, info, listings) or
queues a job on the ``Worker`` and answers with Tinker's ``UntypedAPIFuture``; the client then
polls ``retrieve`` for the result. Methods never touch an engine; the jobs they queue do, on
the worker thread (``harts.serve.training``, ``harts.serve.sampling``). The HTTP layer calls them
on its thread pool, off the event loop (parsing a large body would otherwise stall every other
client), so several may run at once: what they share is under ``_lock`` or is itself thread-safe
(the worker, the futures, the snapshots). Limits on what one request may ask for (datums and
tokens of a batch, tokens of a sample) are checked here, before anything is queued.

Identities follow the SDK: a session id is ours; a training run is ``<session>:train:<n>`` and a
sampling client ``<session>:sample:<n>`` for the client's own counters ``n`` (the SDK derives the
run id of ``create_training_client_from_state`` itself, so the scheme is fixed).

``close()`` of a ServiceClient finishes its session; the server then lets go of that session's
engines (what they wrote under ``--state-dir`` stays). ``--max-models`` counts the runs of live
sessions: a session silent for ``--session-timeout`` is finished by the reaper, or at once when a
new run needs its slot. Publishing, TTLs and downloads of checkpoints are ``self.access``'s
(``harts.serve.access``); a call the server does not serve is refused by ``unserved``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import pydantic
from tinker import types

from harts.errors import UserError
from harts.rl.losses import check_loss
from harts.serve import training
from harts.serve.access import CheckpointAccess, check_ttl
from harts.serve.checkpoints import CheckpointDir, now
from harts.serve.config import ServeConfig
from harts.serve.futures import Done, Failed, FutureStore
from harts.serve.provenance import SequenceLog
from harts.serve.sampling import SampleBatches, SamplerEngines, SampleRun, Snapshots, sample_job, take_snapshot
from harts.serve.training import TrainingRun, json_done
from harts.serve.wire import (
    TinkerPath,
    WireError,
    batch_tokens,
    check_loss_fn,
    check_name,
    describe_validation,
    finite,
    json_body,
    loss_config,
    parse_datums,
    parse_tinker_path,
    split_forward_backward,
    trajectories,
    validate_json,
)
from harts.serve.worker import Job, Step, Worker

if TYPE_CHECKING:
    from harts.trainer.engine import Engine
    from harts.trainer.lora import LoraConfig

__all__ = ["EngineFactory", "ModelInfo", "Service"]

log = logging.getLogger("harts.serve")

M = TypeVar("M", bound=pydantic.BaseModel)

#: ``make_engine(lora, spec)``: a new engine with ``lora`` adapters (None: full weights) over the
#: served model, or over the model directory ``spec`` when given
EngineFactory = Callable[["LoraConfig | None", "str | None"], "Engine"]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server tells clients about the served model."""

    vocab_size: int
    #: transformers' ``model_type`` (``harts`` for a preset)
    arch: str
    #: a directory AutoTokenizer loads, when the model has one
    tokenizer_id: str | None
    #: token ids that end a sample when the client gives no ``stop``
    eos_tokens: tuple[int, ...]


@dataclass(slots=True)
class _Session:
    session_id: str
    user_metadata: dict[str, Any] | None
    display_name: str | None
    #: the tenant whose key created it
    tenant: str
    finished: bool = False
    model_ids: list[str] = field(default_factory=list)
    sampler_ids: list[str] = field(default_factory=list)
    #: ``time.monotonic()`` of its last request or heartbeat (``Service.expire_idle_sessions``)
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(frozen=True, slots=True)
class _Sampler:
    sampler_id: str
    session_id: str
    base_model: str
    #: the tenant whose key created it
    tenant: str
    #: the snapshot it samples (a key of ``Service.snapshots``), or None
    snapshot: str | None = None
    #: the checkpoint it samples when the snapshot is gone (or it has none)
    path: TinkerPath | None = None
    model_path: str | None = None
    #: the training run whose snapshot it samples, when it was made by that run's save
    model_id: str | None = None


class Service:
    """Tinker's endpoints over harts engines (module docstring)."""

    def __init__(
        self,
        config: ServeConfig,
        info: ModelInfo,
        make_engine: EngineFactory,
        *,
        check_run_memory: Callable[[LoraConfig | None], None] | None = None,
    ) -> None:
        self.config = config
        self.info = info
        self.make_engine = make_engine
        #: raises a UserError when one more run with these adapters (None: every weight trained,
        #: a whole model with gradients and AdamW state) would not fit the device now
        self.check_run_memory = check_run_memory
        self.futures = FutureStore()
        self.worker = Worker(self.futures)
        self.checkpoints = CheckpointDir(config.state_dir)
        self.snapshots = Snapshots(config.max_snapshots)
        self.sampler_engines = SamplerEngines()
        #: the batched decoder's shared batches, one per weights source (worker thread only)
        self.sample_batches = SampleBatches()
        #: every sampled sequence by its sequence_id, for the provenance of training datums
        self.sequences = SequenceLog()
        self._lock = threading.RLock()
        self._sessions: dict[str, _Session] = {}
        self._runs: dict[str, TrainingRun] = {}
        self._samplers: dict[str, _Sampler] = {}
        self._seeds = np.random.default_rng(config.seed)
        #: publishing, TTLs and downloads; its lock orders deletions too (two of one checkpoint at
        #: once: one 404, not a race)
        self.access = CheckpointAccess(self.checkpoints, self._owns, config.keys)
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="harts-serve-sessions", daemon=True)
        self._reaper.start()

    # ------------------------------------------------------------------ client configuration
    def client_config(self) -> dict[str, Any]:
        """The SDK's feature flags for this server: API keys, one request per ``forward_backward``
        (so a call is validated whole before any of it applies), per-request polling, and custom
        losses computed client-side."""
        limit = self.config.max_request_bytes
        return types.ClientConfigResponse(
            pjwt_auth_enabled=False,
            credential_default_source="api_key",
            parallel_fwdbwd_chunks=False,
            proto_compress_fwdbwd=False,
            fwdbwd_max_chunk_len=1 << 30,
            fwdbwd_max_chunk_bytes_count=limit // 2,
            fwdbwd_dispatch_bytes_semaphore_size=limit,
            sample_use_retrieve_futures=False,
            custom_loss_server_side=False,
            sample_join_sampling_session=False,
        ).model_dump(mode="json")

    def capabilities(self) -> dict[str, Any]:
        model = types.SupportedModel(
            model_name=self.config.served_name,
            max_context_length=self.config.capacity,
            trainable=True,
            sampleable=True,
        )
        return types.GetServerCapabilitiesResponse(supported_models=[model]).model_dump(mode="json")

    def _check_base_model(self, base_model: str, field: str = "base_model") -> str:
        if not self.config.serves(base_model):
            raise WireError(
                f"{field}: {base_model!r} is not served here; this server serves {self.config.served_name!r}"
            )
        return self.config.served_name

    # ------------------------------------------------------------------ sessions
    def create_session(self, tenant: str, body: bytes) -> dict[str, Any]:
        req = validate_json(body, types.CreateSessionRequest, "create_session")
        sid = uuid.uuid4().hex
        with self._lock:
            self._sessions[sid] = _Session(sid, req.user_metadata, req.display_name, tenant)
        log.info("session %s created (%s)", sid, req.display_name or "no name")
        return types.CreateSessionResponse(session_id=sid).model_dump(mode="json")

    def _own_session(self, tenant: str, session_id: str, field: str = "session_id") -> _Session:
        """Session ``session_id`` of ``tenant``, finished or not (404 for another tenant's, as for
        an unknown one: a tenant learns nothing of another's ids)."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or s.tenant != tenant:
            raise WireError(f"{field}: unknown session {session_id!r}", 404)
        return s

    def _session(self, tenant: str, session_id: str, field: str = "session_id") -> _Session:
        s = self._own_session(tenant, session_id, field)
        if s.finished:
            raise WireError(f"{field}: session {session_id} is finished", 410)
        s.last_seen = time.monotonic()
        return s

    def heartbeat(self, tenant: str, body: bytes) -> dict[str, Any]:
        req = validate_json(body, types.SessionHeartbeatRequest, "session_heartbeat")
        self._session(tenant, req.session_id)
        return types.SessionHeartbeatResponse().model_dump(mode="json")

    def finish_session(self, tenant: str, session_id: str) -> dict[str, Any]:
        """End a session: its runs and sampling clients are released (checkpoints stay)."""
        self._finish(self._own_session(tenant, session_id), "finished")
        return {}

    def _finish(self, s: _Session, why: str) -> None:
        """Mark ``s`` finished and release its runs, sampling clients and queued work."""
        with self._lock:
            if s.finished:
                return
            s.finished = True
            runs = [self._runs.pop(m) for m in s.model_ids if m in self._runs]
            for sid in s.sampler_ids:
                self._samplers.pop(sid, None)
        for run in runs:
            self.worker.forget(run.model_id)
            self.snapshots.drop_run(run.model_id)
        # nobody retrieves the rest of its requests: its queued samples are dropped unrun
        self.worker.drop_owner(s.session_id, f"session {s.session_id} {why}")
        log.info("session %s %s; released %d training runs", s.session_id, why, len(runs))

    def expire_idle_sessions(self, now: float | None = None) -> list[str]:
        """Finish every session that sent no request and no heartbeat for ``--session-timeout``
        seconds (the SDK heartbeats every 10 s while its client lives): a client that crashed or
        lost its network never calls ``close()``, and its runs would hold their memory and their
        ``--max-models`` slots, and its queued samples the worker, until a restart. Returns the
        ids finished. ``now``: ``time.monotonic()``'s reading to judge by."""
        now = time.monotonic() if now is None else now
        limit = self.config.session_timeout
        with self._lock:
            idle = [s for s in self._sessions.values() if not s.finished and now - s.last_seen > limit]
        for s in idle:
            self._finish(s, f"expired ({limit:g} s without a request or heartbeat)")
        return [s.session_id for s in idle]

    def _reap(self) -> None:
        """The sessions' reaper thread: ``expire_idle_sessions`` a few times per timeout."""
        while not self._closed.wait(max(1.0, self.config.session_timeout / 4)):
            try:
                self.expire_idle_sessions()
                self.access.expire()
            except Exception:  # a bug of ours: logged, and the server keeps serving
                log.exception("expiring idle sessions or checkpoints failed")

    def get_session(self, tenant: str, session_id: str) -> dict[str, Any]:
        s = self._own_session(tenant, session_id)
        return types.GetSessionResponse(
            training_run_ids=list(s.model_ids),
            sampler_ids=list(s.sampler_ids),
            user_metadata=s.user_metadata,
            display_name=s.display_name,
        ).model_dump(mode="json")

    def list_sessions(self, tenant: str) -> dict[str, Any]:
        with self._lock:
            own = [sid for sid, s in self._sessions.items() if s.tenant == tenant]
        return types.ListSessionsResponse(sessions=own).model_dump(mode="json")

    # ------------------------------------------------------------------ futures
    def _future(self, request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id, **extra).model_dump(
            mode="json", exclude_none=True
        )

    def _queue(
        self,
        kind: str,
        run: Callable[[], Step],
        *,
        tenant: str,
        key: str | None = None,
        seq_id: int | None = None,
        lane: str | None = None,
        owner: str | None = None,
    ) -> str:
        """Queue a job (``harts.serve.worker``): ``key`` / ``seq_id`` order it within a training run,
        ``lane`` is where it takes turns (None: its key's), ``owner`` the session (the client) it takes
        turns as and is dropped with (None: the session of the run ``key`` names)."""
        if key is not None and seq_id is not None:
            first = self.worker.taken(key, seq_id)
            if first is not None:
                return first
        if owner is None and key is not None:
            with self._lock:
                run_of_key = self._runs.get(key)
            owner = None if run_of_key is None else run_of_key.session_id
        request_id = self.futures.create(kind, tenant)
        job = Job(request_id=request_id, kind=kind, run=run, key=key, seq_id=seq_id, lane=lane, owner=owner)
        return self.worker.submit(job)

    async def retrieve(self, tenant: str, body: bytes) -> tuple[bytes, str]:
        """One long poll of ``retrieve_future``: the result, a failure, or "try again"."""
        req = validate_json(body, types.FutureRetrieveRequest, "retrieve_future")
        try:
            outcome = await self.futures.wait(req.request_id, self.config.poll_seconds, tenant)
        except KeyError:
            raise WireError(f"request_id: unknown request {req.request_id!r}", 404) from None
        if outcome is None:
            pending = {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
            return json.dumps(pending).encode(), "application/json"
        if isinstance(outcome, Failed):
            return json.dumps({"error": outcome.message, "category": outcome.category}).encode(), "application/json"
        return outcome.body, outcome.media_type

    # ------------------------------------------------------------------ training runs
    def _run(self, tenant: str, model_id: str, field: str = "model_id") -> TrainingRun:
        with self._lock:
            run = self._runs.get(model_id)
        if run is None or run.tenant != tenant:
            raise WireError(f"{field}: no training run {model_id!r} is loaded on this server", 404)
        run.last_request = now()
        return run

    def _new_run(
        self,
        session: _Session,
        model_seq_id: int,
        base_model: str,
        lora: dict[str, Any] | None,
        user_metadata: dict[str, Any] | None,
    ) -> TrainingRun:
        model_id = f"{session.session_id}:train:{model_seq_id}"
        with self._lock:
            full = model_id not in self._runs and len(self._runs) >= self.config.max_models
        if full:
            # only live runs count: a session silent past --session-timeout is finished now, not
            # at the reaper's next round
            self.expire_idle_sessions()
        with self._lock:
            if model_id in self._runs:
                return self._runs[model_id]
            if len(self._runs) >= self.config.max_models:
                raise WireError(
                    f"model_seq_id: the server holds {len(self._runs)} training runs of live sessions (--max-models "
                    f"{self.config.max_models}); close() a ServiceClient to release its runs (a session without a "
                    f"request or heartbeat for --session-timeout {self.config.session_timeout:g} s releases them), "
                    "or restart with more"
                )
            run = TrainingRun(
                model_id, session.session_id, base_model, lora, now(), user_metadata, tenant=session.tenant
            )
            self._runs[model_id] = run
            session.model_ids.append(model_id)
        return run

    @contextmanager
    def _creating(self, run: TrainingRun) -> Iterator[None]:
        """A run whose creation fails is unregistered (its later requests get 404)."""
        try:
            yield
        except BaseException:
            with self._lock:
                self._runs.pop(run.model_id, None)
            self.worker.forget(run.model_id)
            raise

    def create_model(self, tenant: str, body: bytes) -> dict[str, Any]:
        req = validate_json(body, types.CreateModelRequest, "create_model")
        session = self._session(tenant, req.session_id)
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        first = self.worker.taken(model_id, 0)
        if first is not None:
            return self._future(first, model_id)
        base = self._check_base_model(req.base_model)
        _check_optimizer(req.optimizer_config, "optimizer_config")
        lora = None
        if req.lora_config is not None:
            lc = req.lora_config
            lora = {
                "rank": lc.rank,
                "seed": self.config.seed if lc.seed is None else lc.seed,
                "train_attn": lc.train_attn,
                "train_mlp": lc.train_mlp,
                "train_unembed": lc.train_unembed,
            }
            _lora_config(lora)  # checked now, not in the job
        else:
            self._check_full_weights()
        run = self._new_run(session, req.model_seq_id, base, lora, req.user_metadata)

        def create() -> Done:
            with self._creating(run):
                self._check_adapters(run.lora)
                run.engine = self.make_engine(_lora_config(run.lora), None)
                self.checkpoints.write_run(run.model_id, run.record())
            log.info("training run %s created (%s)", run.model_id, _describe_lora(run.lora))
            return json_done(types.CreateModelResponse(model_id=run.model_id))

        return self._future(self._queue("CreateModel", create, tenant=tenant, key=model_id, seq_id=0), model_id)

    def get_info(self, tenant: str, body: bytes) -> dict[str, Any]:
        req = validate_json(body, types.GetInfoRequest, "get_info")
        run = self._run(tenant, req.model_id)
        return types.GetInfoResponse(
            type="get_info",
            model_data=types.ModelData(
                arch=self.info.arch, model_name=run.base_model, tokenizer_id=self.info.tokenizer_id
            ),
            model_id=run.model_id,
            is_lora=run.lora is not None,
            lora_rank=None if run.lora is None else run.lora["rank"],
            model_name=run.base_model,
        ).model_dump(mode="json", exclude_none=True)

    def _ordered(self, model_id: str, seq_id: int | None, field: str = "seq_id") -> int | None:
        """Check ``seq_id`` (None: the request runs when it arrives, after what is queued)."""
        if seq_id is None:
            return None
        if seq_id < 1:
            raise WireError(f"{field}: {seq_id}; a training client's requests are numbered from 1")
        if self.worker.is_past(model_id, seq_id):
            raise WireError(f"{field}: request {seq_id} of {model_id} was refused before; it cannot run now")
        return seq_id

    def _ordered_request(
        self, tenant: str, body: bytes, model: type[M], what: str
    ) -> tuple[M, TrainingRun, int | None]:
        """(request, its run, its sequence number) of a training client's JSON request; a request
        refused for a bad field still frees its sequence number when it names one."""
        data = json_body(body, what)
        try:
            req = model.model_validate(data)
        except pydantic.ValidationError as err:
            error = WireError(f"{what}: {describe_validation(err)}")
            model_id, seq_id = data.get("model_id"), data.get("seq_id")
            if isinstance(model_id, str) and isinstance(seq_id, int) and self._holds(tenant, model_id):
                raise self._refuse(model_id, seq_id, error) from None
            raise error from None
        run = self._run(tenant, req.model_id)  # type: ignore[attr-defined]
        return req, run, self._ordered(run.model_id, req.seq_id)  # type: ignore[attr-defined]

    def _refuse(self, model_id: str, seq_id: int | None, err: WireError) -> WireError:
        """A refused ordered request still used its number: let the ones after it run."""
        if seq_id is not None and seq_id >= 1 and self.worker.taken(model_id, seq_id) is None:
            self.worker.skip(model_id, seq_id)
        return err

    def forward_backward(self, tenant: str, body: bytes, content_encoding: str | None) -> dict[str, Any]:
        limits = self.config
        msg, datums = split_forward_backward(
            body, content_encoding, max_bytes=limits.max_request_bytes, max_datums=limits.max_datums
        )
        run = self._run(tenant, msg.model_id)
        seq = self._ordered(run.model_id, msg.seq_id)
        if seq is not None and (first := self.worker.taken(run.model_id, seq)) is not None:
            return self._future(first, run.model_id)
        try:
            parse_datums(msg, datums, max_datums=limits.max_datums, max_tokens=limits.capacity)
            if (tokens := batch_tokens(msg)) > limits.max_batch_tokens:
                raise WireError(
                    f"forward_backward_input.data: {tokens} tokens in {len(msg.data)} datums; this server takes at "
                    f"most {limits.max_batch_tokens} per request (--max-batch-tokens): split the batch"
                )
            cfg = loss_config(msg)
            loss_fn = check_loss_fn(msg.loss_fn)
            try:
                check_loss(loss_fn, cfg)
            except UserError as err:
                raise WireError(f"forward_backward_input.loss_fn_config: {err}") from None
            trajs = trajectories(msg, vocab_size=self.info.vocab_size, max_tokens=self.config.capacity)
            lengths = [len(t["tokens"]) - 1 for t in trajs]
            self.sequences.check(msg, lengths, tenant=tenant, session_id=run.session_id)
        except WireError as err:
            raise self._refuse(run.model_id, seq, err) from None
        forward_only = msg.forward_only

        def work() -> Done:
            return training.forward_backward(run.live_engine(), trajs, loss_fn, cfg, forward_only=forward_only)

        kind = "Forward" if forward_only else "ForwardBackward"
        return self._future(self._queue(kind, work, tenant=tenant, key=run.model_id, seq_id=seq), run.model_id)

    def optim_step(self, tenant: str, body: bytes) -> dict[str, Any]:
        req, run, seq = self._ordered_request(tenant, body, types.OptimStepRequest, "optim_step")
        try:
            params = _adam_params(req.optim_params)
        except WireError as err:
            raise self._refuse(run.model_id, seq, err) from None

        def work() -> Done:
            metrics = training.optim_step(run.live_engine(), params)
            run.version += 1
            return json_done(types.OptimStepResponse(metrics=metrics))

        return self._future(self._queue("OptimStep", work, tenant=tenant, key=run.model_id, seq_id=seq), run.model_id)

    # ------------------------------------------------------------------ checkpoints
    def save_weights(self, tenant: str, body: bytes) -> dict[str, Any]:
        req, run, seq = self._ordered_request(tenant, body, types.SaveWeightsRequest, "save_weights")
        try:
            check_ttl(req.ttl_seconds)
            name = check_name(req.path or f"state-{uuid.uuid4().hex[:8]}", "path")
            tp = TinkerPath(run.model_id, "weights", name)
            if not req.overwrite and self.checkpoints.exists(tp):
                raise WireError(f"path: checkpoint {tp} exists; pass overwrite=True to replace it")
        except WireError as err:
            raise self._refuse(run.model_id, seq, err) from None

        def work() -> Done:
            self.checkpoints.write_run(run.model_id, run.record())
            self.checkpoints.save(
                tp,
                run.live_engine().save_state,
                overwrite=req.overwrite,
                ttl_seconds=req.ttl_seconds,
                user_metadata=req.user_metadata,
            )
            return json_done(types.SaveWeightsResponse(path=str(tp), type="save_weights"))

        return self._future(self._queue("SaveWeights", work, tenant=tenant, key=run.model_id, seq_id=seq), run.model_id)

    def save_weights_for_sampler(self, tenant: str, body: bytes) -> dict[str, Any]:
        req, run, seq = self._ordered_request(
            tenant, body, types.SaveWeightsForSamplerRequest, "save_weights_for_sampler"
        )
        try:
            check_ttl(req.ttl_seconds)
            tp, sampler_id = self._sampler_target(run, req)
        except WireError as err:
            raise self._refuse(run.model_id, seq, err) from None
        key = sampler_id or str(tp)
        if sampler_id is not None:
            with self._lock:
                self._samplers[sampler_id] = _Sampler(
                    sampler_id, run.session_id, run.base_model, tenant, snapshot=key, model_id=run.model_id
                )
                self._sessions[run.session_id].sampler_ids.append(sampler_id)

        def work() -> Done:
            engine = run.live_engine()
            if tp is not None:
                self.checkpoints.write_run(run.model_id, run.record())
                self.checkpoints.save(
                    tp,
                    engine.save_weights_for_sampler,
                    overwrite=True,
                    ttl_seconds=req.ttl_seconds,
                    user_metadata=req.user_metadata,
                )
            self.snapshots.put(key, take_snapshot(run.model_id, run.version, engine.model))
            return json_done(
                types.SaveWeightsForSamplerResponseInternal(
                    path=None if tp is None else str(tp),
                    sampling_session_id=sampler_id,
                    type="save_weights_for_sampler",
                )
            )

        job = self._queue("SaveWeightsForSampler", work, tenant=tenant, key=run.model_id, seq_id=seq)
        return self._future(job, run.model_id)

    def _sampler_target(self, run: TrainingRun, req: Any) -> tuple[TinkerPath | None, str | None]:
        """(the named checkpoint to write, the new sampling client's id) of a sampler save."""
        if req.path is not None:
            return TinkerPath(run.model_id, "sampler_weights", check_name(req.path, "path")), None
        if req.sampling_session_seq_id is None:
            raise WireError("path: give a checkpoint name, or sampling_session_seq_id for an unnamed snapshot")
        return None, f"{run.session_id}:sample:{req.sampling_session_seq_id}"

    def save_weights_external(self, tenant: str, body: bytes) -> dict[str, Any]:
        """``save_weights_external``: the weights as ``save_weights_for_sampler`` writes them
        (transformers' layout, adapters merged), as ``tinker://<run>/external_weights/<name>``,
        for ``get_external_weights_urls`` and ``tinker checkpoint download`` to fetch."""
        req, run, seq = self._ordered_request(tenant, body, types.SaveWeightsExternalRequest, "save_weights_external")
        try:
            check_ttl(req.ttl_seconds)
            if req.age_encryption_recipients:
                raise WireError(
                    "age_encryption_recipients: harts serve does not encrypt exports; leave it out (the files are "
                    "served to the run's tenant only, over the server's connection)"
                )
            tp = TinkerPath(run.model_id, "external_weights", check_name(req.path, "path"))
        except WireError as err:
            raise self._refuse(run.model_id, seq, err) from None

        def work() -> Done:
            self.checkpoints.write_run(run.model_id, run.record())
            engine = run.live_engine()
            self.checkpoints.save(tp, engine.save_weights_for_sampler, overwrite=True, ttl_seconds=req.ttl_seconds)
            size = self.checkpoints.metadata(tp).get("size_bytes")
            return json_done(
                types.SaveWeightsExternalResponseInternal(path=str(tp), size_bytes=size, type="save_weights_external")
            )

        job = self._queue("SaveWeightsExternal", work, tenant=tenant, key=run.model_id, seq_id=seq)
        return self._future(job, run.model_id)

    def _saved_state(self, tenant: str, path: str) -> tuple[TinkerPath, dict[str, Any]]:
        """(the training checkpoint ``path`` names, its run's record); 404 when it is not on disk
        or not ``tenant``'s."""
        tp = parse_tinker_path(path, "path", kinds=("weights",))
        source = self.checkpoints.read_run(tp.model_id)
        if source is None or not self.access.readable(tenant, tp, source) or not self.checkpoints.exists(tp):
            raise WireError(f"path: no checkpoint {tp} on this server", 404)
        return tp, source

    def load_weights(self, tenant: str, body: bytes) -> dict[str, Any]:
        req = validate_json(body, types.LoadWeightsRequest, "load_weights")
        if req.session_id is not None:
            return self._create_from_state(tenant, req, *self._saved_state(tenant, req.path))
        if req.model_id is None:
            raise WireError("model_id: give model_id (load into a run) or session_id and model_seq_id (a new run)")
        run = self._run(tenant, req.model_id)
        seq = self._ordered(run.model_id, req.seq_id)
        try:
            tp, _ = self._saved_state(tenant, req.path)
        except WireError as err:
            raise self._refuse(run.model_id, seq, err) from None
        path, optimizer = self.checkpoints.path(tp), req.optimizer

        def work() -> Done:
            engine = run.live_engine()
            engine.load_state(path)
            if not optimizer:
                training.reset_optimizer(engine)
            run.version += 1
            return json_done(types.LoadWeightsResponse(path=str(tp), model_id=run.model_id, type="load_weights"))

        return self._future(self._queue("LoadWeights", work, tenant=tenant, key=run.model_id, seq_id=seq), run.model_id)

    def _check_full_weights(self) -> None:
        """A 4xx naming ``lora_config`` when a run without LoRA (a whole model with gradients and
        AdamW state) would not fit the device now, before anything of it is built."""
        if self.check_run_memory is None:
            return
        try:
            self.check_run_memory(None)
        except UserError as err:
            raise WireError(
                f"lora_config: none given, so every weight would train, and {err}; pass a lora_config"
            ) from None

    def _check_adapters(self, lora: dict[str, Any] | None) -> None:
        """In the run's creation job (no step runs beside it, so the device's free memory is what
        the run can have): a ``UserError`` naming ``lora_config`` when its adapters, their
        gradients and AdamW state and one step would not fit."""
        if lora is None or self.check_run_memory is None:
            return
        try:
            self.check_run_memory(_lora_config(lora))
        except UserError as err:
            raise UserError(f"lora_config: {err}") from None

    def _create_from_state(self, tenant: str, req: Any, tp: TinkerPath, source: dict[str, Any]) -> dict[str, Any]:
        """``create_training_client_from_state[_with_optimizer]``: a new run from a saved state."""
        session = self._session(tenant, req.session_id)
        if req.model_seq_id is None:
            raise WireError("model_seq_id: required with session_id (the new run's number in the session)")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        first = self.worker.taken(model_id, 0)
        if first is not None:
            return self._future(first, model_id)
        base = self._check_base_model(req.base_model or source["base_model"])
        if req.optimizer_config is not None:
            _check_optimizer(req.optimizer_config, "optimizer_config")
        if source.get("lora") is None:
            self._check_full_weights()
        run = self._new_run(session, req.model_seq_id, base, source.get("lora"), req.user_metadata)
        path, optimizer = self.checkpoints.path(tp), req.optimizer

        def create() -> Done:
            with self._creating(run):
                self._check_adapters(run.lora)
                engine = self.make_engine(_lora_config(run.lora), None)
                engine.load_state(path)
                if not optimizer:
                    training.reset_optimizer(engine)
                run.engine = engine
                self.checkpoints.write_run(run.model_id, run.record())
            log.info("training run %s created from %s", run.model_id, tp)
            return json_done(types.LoadWeightsResponse(path=str(tp), model_id=run.model_id, type="load_weights"))

        return self._future(self._queue("LoadWeights", create, tenant=tenant, key=model_id, seq_id=0), model_id)

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, tenant: str, body: bytes) -> dict[str, Any]:
        req = validate_json(body, types.CreateSamplingSessionRequest, "create_sampling_session")
        session = self._session(tenant, req.session_id)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        sampler = self._sampler_for(tenant, sampler_id, session.session_id, req.base_model, req.model_path)
        with self._lock:
            if sampler_id not in self._samplers:
                session.sampler_ids.append(sampler_id)
            self._samplers[sampler_id] = sampler
        return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id).model_dump(mode="json")

    def _sampler_for(
        self, tenant: str, sampler_id: str, session_id: str, base_model: str | None, model_path: str | None
    ) -> _Sampler:
        if model_path is None:
            if base_model is None:
                raise WireError("base_model: give base_model or model_path")
            return _Sampler(sampler_id, session_id, self._check_base_model(base_model), tenant)
        tp = parse_tinker_path(model_path, "model_path")
        source = self.checkpoints.read_run(tp.model_id)
        in_memory = self.snapshots.get(str(tp)) is not None
        if not (source is not None and self.access.readable(tenant, tp, source)) or not (
            in_memory or self.checkpoints.exists(tp)
        ):
            raise WireError(f"model_path: no checkpoint {tp} on this server", 404)
        if base_model is not None:
            self._check_base_model(base_model)
        key = str(tp) if tp.kind == "sampler_weights" else None
        return _Sampler(
            sampler_id, session_id, source["base_model"], tenant, snapshot=key, path=tp, model_path=model_path
        )

    def get_sampler(self, tenant: str, sampler_id: str) -> dict[str, Any]:
        with self._lock:
            s = self._samplers.get(sampler_id)
        if s is None or s.tenant != tenant:
            raise WireError(f"sampler_id: unknown sampling client {sampler_id!r}", 404)
        return types.GetSamplerResponse(
            sampler_id=s.sampler_id, base_model=s.base_model, model_path=s.model_path
        ).model_dump(mode="json", exclude_none=True)

    def asample(self, tenant: str, body: bytes) -> dict[str, Any]:
        req = validate_json(body, types.SampleRequest, "asample")
        if req.sampling_session_id is not None:
            with self._lock:
                sampler = self._samplers.get(req.sampling_session_id)
            if sampler is None or sampler.tenant != tenant:
                raise WireError(f"sampling_session_id: unknown sampling client {req.sampling_session_id!r}", 404)
        else:
            sampler = self._sampler_for(tenant, "direct", "", req.base_model, req.model_path)
        job = sample_job(
            req,
            vocab_size=self.info.vocab_size,
            eos_tokens=self.info.eos_tokens,
            capacity=self.config.capacity,
            max_samples=self.config.max_samples,
            default_seed=self._seed(),
            max_sample_tokens=self.config.max_sample_tokens,
            tokenizer=self.info.tokenizer_id,
        )
        # the sequences' ids, made before the job runs: it tells the log how long each sample came out
        prefix = uuid.uuid4().hex
        ids = [f"{prefix}:{i}" for i in range(job.num_samples)]
        self.sequences.record(
            ids,
            tenant=tenant,
            session_id=sampler.session_id,
            prompt_length=len(job.prompt),
            max_tokens=job.config.max_tokens,
        )
        sampling = SampleRun(
            job,
            lambda: self._sampling_weights(sampler),
            on_done=lambda lengths: self.sequences.sampled(ids, lengths),
            batches=self.sample_batches,
            # what _sampling_weights reads: requests of one source sample the same weights
            weights_key=(sampler.snapshot, None if sampler.path is None else str(sampler.path)),
        )
        # its turns are those of the run whose weights it samples (after that run's save), else its own
        lane = sampler.model_id or (sampler.path.model_id if sampler.path is not None else None)
        lane = lane or f"sampler:{tenant}:{sampler.sampler_id}"
        request_id = self._queue("Sample", sampling.step, tenant=tenant, lane=lane, owner=sampler.session_id or None)
        # finished by another request's slice of a shared batch: answered at once
        sampling.settle = lambda done: self.worker.settle(request_id, done)
        return self._future(request_id, sample_sequence_ids=ids)

    def _seed(self) -> int:
        """The seed of a sampling request that names none (the generator is shared by threads)."""
        with self._lock:
            return int(self._seeds.integers(2**62))

    def cancel_future(self, tenant: str, body: bytes) -> dict[str, Any]:
        """``cancel_future``: the SDK sends it for a sampling future it stopped waiting for. The
        request is dropped if it has not run, or stops after its current slice; its future fails
        with "cancelled". A finished request stays as it is; only sampling requests cancel (a
        training client's requests are numbered, and the ones after a step depend on it)."""
        data = json_body(body, "cancel_future")
        request_id = data.get("request_id")
        if not isinstance(request_id, str):
            raise WireError("request_id: required (the id of the sampling request to cancel)")
        kind = self.futures.kind(request_id, tenant)
        if kind is None:
            raise WireError(f"request_id: unknown request {request_id!r}", 404)
        if kind != "Sample":
            raise WireError(f"request_id: {request_id} is a {kind} request; only sampling requests can be cancelled")
        if self.worker.cancel(request_id, "cancelled by the client"):
            log.info("sampling request %s cancelled", request_id)
        return {}

    def _sampling_weights(self, sampler: _Sampler) -> tuple[Engine, dict[str, Any] | None]:
        """(engine, tensors to swap in) a sampler samples with -- on the worker thread."""
        if sampler.snapshot is not None:
            snap = self.snapshots.get(sampler.snapshot)
            with self._lock:
                run = None if snap is None else self._runs.get(snap.model_id)
            if snap is not None and run is not None and run.engine is not None:
                return run.engine, (None if run.version == snap.version else snap.tensors)
        tp = sampler.path
        if tp is None:
            if sampler.snapshot is not None:
                raise UserError(
                    f"the weights of sampling client {sampler.sampler_id} are no longer held (--max-snapshots "
                    f"{self.config.max_snapshots} newer snapshots, or its training run was released); save again"
                )
            return self.sampler_engines.get("base", lambda: self.make_engine(None, None)), None
        directory = str(self.checkpoints.path(tp))
        if tp.kind != "weights":  # sampler_weights, external_weights: the HF export, adapters merged
            return self.sampler_engines.get(directory, lambda: self.make_engine(None, directory)), None
        source = self.checkpoints.read_run(tp.model_id) or {}

        def load() -> Engine:
            engine = self.make_engine(_lora_config(source.get("lora")), None)
            engine.load_state(directory)
            return engine

        return self.sampler_engines.get(directory, load), None

    # ------------------------------------------------------------------ ownership
    def _record_owner(self, record: dict[str, Any]) -> str | None:
        """The tenant of a run by its ``run.json``: the one it names; for one written before runs
        recorded their tenant, ``ServeConfig.legacy_owner`` (None: nobody's)."""
        if "tenant" not in record:
            return self.config.legacy_owner
        tenant = record["tenant"]
        return tenant if isinstance(tenant, str) else None

    def _owns(self, tenant: str, model_id: str, record: dict[str, Any] | None = None) -> bool:
        """True when training run ``model_id`` is ``tenant``'s: the loaded run's tenant, else the
        one its ``run.json`` (``record`` when already read) names. Callers answer 404 otherwise,
        as for a run that does not exist, so a tenant learns nothing of another's ids."""
        with self._lock:
            run = self._runs.get(model_id)
        if run is not None:
            return run.tenant == tenant
        if record is None:
            record = self.checkpoints.read_run(model_id)
        return record is not None and self._record_owner(record) == tenant

    def _holds(self, tenant: str, model_id: str) -> bool:
        """True when ``tenant``'s training run ``model_id`` is loaded."""
        with self._lock:
            run = self._runs.get(model_id)
        return run is not None and run.tenant == tenant

    # ------------------------------------------------------------------ listings (RestClient)
    def _run_record(self, tenant: str, model_id: str) -> dict[str, Any]:
        with self._lock:
            run = self._runs.get(model_id)
        record = run.record() if run is not None else self.checkpoints.read_run(model_id)
        if record is None or not self._owns(tenant, model_id, record):
            raise WireError(f"training_run_id: no training run {model_id!r} on this server", 404)
        checkpoints = [types.Checkpoint.model_validate(c) for c in self.checkpoints.listing(model_id)]
        last = {kind: [c for c in checkpoints if c.checkpoint_type == kind] for kind in ("training", "sampler")}
        lora = record.get("lora")
        return types.TrainingRun(
            training_run_id=model_id,
            base_model=record["base_model"],
            model_owner="harts",
            is_lora=lora is not None,
            lora_rank=None if lora is None else lora["rank"],
            last_request_time=(run.last_request or run.created) if run is not None else record["created"],
            last_checkpoint=last["training"][-1] if last["training"] else None,
            last_sampler_checkpoint=last["sampler"][-1] if last["sampler"] else None,
            user_metadata=_string_metadata(record.get("user_metadata")),
        ).model_dump(mode="json", exclude_none=True)

    def training_run(self, tenant: str, model_id: str) -> dict[str, Any]:
        return self._run_record(tenant, model_id)

    def _own_run_ids(self, tenant: str) -> list[str]:
        """``tenant``'s training runs: those on disk (oldest first), then those only in memory."""
        ids = self.checkpoints.run_ids()
        with self._lock:
            ids += [m for m in self._runs if m not in ids]
        return [m for m in ids if self._owns(tenant, m)]

    def training_runs(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        ids = self._own_run_ids(tenant)
        page = ids[offset : offset + limit]
        return {
            "training_runs": [self._run_record(tenant, m) for m in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)},
        }

    def list_checkpoints(self, tenant: str, model_id: str) -> dict[str, Any]:
        if not self._owns(tenant, model_id):
            raise WireError(f"training_run_id: no training run {model_id!r} on this server", 404)
        listing = [types.Checkpoint.model_validate(c) for c in self.checkpoints.listing(model_id)]
        return types.CheckpointsListResponse(checkpoints=listing).model_dump(mode="json")

    def user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        every = [c for m in self._own_run_ids(tenant) for c in self.checkpoints.listing(m)]
        every.sort(key=lambda c: c["time"], reverse=True)
        return {
            "checkpoints": every[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(every)},
        }

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> dict[str, Any]:
        tp = parse_tinker_path(f"tinker://{model_id}/{checkpoint_id}", "checkpoint_id")
        if not self._owns(tenant, tp.model_id):
            raise WireError(f"checkpoint {tp} does not exist", 404)
        with self.access.lock:
            self.checkpoints.delete(tp)
        return {}

    def unserved(self, tenant: str, method: str, path: str, body: bytes) -> None:
        """Refuse a call this server does not serve, as a 404 naming it. A training client's call
        names its run and sequence number, and the SDK has used that number already: it is
        skipped, so the client's later requests run."""
        err = WireError(
            f"{method} /api/v1/{path}: harts serve does not serve this call (docs/SERVE.md lists those it does)", 404
        )
        try:
            data = json.loads(body) if body else None
        except (ValueError, RecursionError):
            data = None
        if isinstance(data, dict):
            model_id, seq_id = data.get("model_id"), data.get("seq_id")
            if isinstance(model_id, str) and type(seq_id) is int and self._holds(tenant, model_id):
                raise self._refuse(model_id, seq_id, err)
        raise err

    def weights_info(self, tenant: str, body: bytes) -> dict[str, Any]:
        data = json_body(body, "weights_info")
        path = data.get("tinker_path")
        if not isinstance(path, str):
            raise WireError("tinker_path: required (a tinker:// path)")
        tp = parse_tinker_path(path, "tinker_path")
        record = self.checkpoints.read_run(tp.model_id)
        if record is None or not self.access.readable(tenant, tp, record) or not self.checkpoints.exists(tp):
            raise WireError(f"tinker_path: no checkpoint {tp} on this server", 404)
        lora = record.get("lora")
        return types.WeightsInfoResponse(
            base_model=record["base_model"],
            is_lora=lora is not None,
            lora_rank=None if lora is None else lora["rank"],
            train_attn=None if lora is None else lora["train_attn"],
            train_mlp=None if lora is None else lora["train_mlp"],
            train_unembed=None if lora is None else lora["train_unembed"],
        ).model_dump(mode="json", exclude_none=True)

    def close(self) -> None:
        """Stop the worker after the running job (queued work is dropped), and the reaper."""
        self._closed.set()
        self.worker.stop()


def _lora_config(lora: dict[str, Any] | None) -> LoraConfig | None:
    """harts' ``LoraConfig`` from Tinker's fields (alpha: harts' default, 32, as Tinker uses)."""
    if lora is None:
        return None
    from harts.trainer.lora import LoraConfig

    cfg = LoraConfig(
        rank=lora["rank"],
        seed=lora["seed"],
        train_attn=lora["train_attn"],
        train_mlp=lora["train_mlp"],
        train_unembed=lora["train_unembed"],
    )
    try:
        cfg.validate()
    except UserError as err:
        raise WireError(f"lora_config: {err}") from None
    return cfg


def _string_metadata(meta: Any) -> dict[str, str] | None:
    """A run's user metadata as Tinker's ``TrainingRun`` carries it: a value that is no string
    (``create_model`` takes any JSON) as its JSON text."""
    if not isinstance(meta, dict):
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v, default=str) for k, v in meta.items()}


def _describe_lora(lora: dict[str, Any] | None) -> str:
    if lora is None:
        return "full weights"
    parts = [k.removeprefix("train_") for k in ("train_attn", "train_mlp", "train_unembed") if lora[k]]
    return f"LoRA rank {lora['rank']} on {', '.join(parts)}"


def _check_optimizer(cfg: Any, field: str) -> None:
    kind = getattr(cfg, "type", "adamw")
    if kind != "adamw":
        raise WireError(f"{field}.type: {kind!r}; harts serve trains with AdamW only ('adamw')")


def _adam_params(params: Any) -> Any:
    """Tinker's ``AdamParams`` checked field by field (other optimizers refused)."""
    if not isinstance(params, types.AdamParams):
        raise WireError(f"optim_params.type: {getattr(params, 'type', '?')!r}; harts serve takes AdamParams only")
    checks = (
        ("beta1", 0 <= params.beta1 < 1),
        ("beta2", 0 <= params.beta2 < 1),
        ("eps", params.eps > 0),
        ("weight_decay", params.weight_decay >= 0),
        ("grad_clip_norm", params.grad_clip_norm >= 0),
    )
    for name, ok in checks:
        value = finite(float(getattr(params, name)), f"optim_params.{name}")
        if not ok:
            raise WireError(f"optim_params.{name}: {value} is out of range")
    training.check_adam_params(params)  # the learning rate's range, lr x weight_decay
    return params

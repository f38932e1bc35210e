"""``harts serve``: a Tinker-compatible HTTP training server over ``harts.trainer.engine.Engine``.

The real ``tinker`` SDK's ServiceClient, TrainingClient, SamplingClient and RestClient talk to
it as to Tinker, with the SDK's own wire types on both ends. Modules, outside in:

    app          the FastAPI app: API key -> tenant, body limit, one route per Tinker endpoint
    tenants      keys belong to tenants (--api-key, --keys-file); a tenant sees only its own items
    service      what each endpoint does: validate, register, queue (no engine calls)
    worker       the one thread that runs engine work: runs take turns, each client's requests in order
    futures      request records, resolved exactly once, polled by retrieve_future
    training     a training run and its forward_backward / optim_step / checkpoint work
    sampling     sampling (the batched decoder on CUDA, the reference elsewhere; the prompt's
                 state forked per sample), weight snapshots
    provenance   the sequences sampling returned, by sequence id, and datums checked against them
    tokenizer    the served tokenizer (--tokenizer) and the decoding of stop strings
    checkpoints  the state directory: tinker:// paths -> directories that cannot escape it
    access       checkpoints out: publish / unpublish / TTL, signed download URLs, archives
    wire         tinker's request types and protobufs <-> harts trajectories and results
    config       ServeConfig
    server       model facts, the engine factory, uvicorn
    connections  uvicorn's connection limits and the request-head timeout

``harts serve --help`` lists the options; ``docs/SERVE.md`` is the guide.
"""

"""Scaling past one GPU on torch's own engine: FSDP2, expert, context and tensor parallelism, DCP checkpoints.

Parallelism is applied to a ``HybridLM`` from outside; the model files keep the architecture only.

* ``mesh.py``: ``ParallelConfig`` (``--dp``, ``--ep``, ``--cp``, ``--tp``), ``init_parallel`` -> ``ParallelState``;
* ``parallelize.py``: ``parallelize(model, state)`` (FSDP2 per decoder layer, expert parallelism),
  gradient sync once per step, ``clip_grad_norm`` over shards;
* ``expert_parallel.py``: the all-to-all token dispatch of the MoE layers;
* ``context_parallel.py``: Ulysses context parallelism, each microbatch's rows split over the
  ``cp`` ranks with all-to-alls around every token mixer;
* ``tensor_parallel.py``: tensor parallelism with sequence parallelism (``parallelize_module``):
  local heads per rank, rows sequence-sharded between blocks;
* ``build.py``: a parallel model built on the meta device, sharded, then given its values;
* ``checkpoint.py``: sharded, resumable checkpoints (``save_checkpoint``, ``load_checkpoint``).
"""

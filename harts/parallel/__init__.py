"""Scaling past one GPU on torch's own engine: FSDP2, expert and context parallelism, DCP checkpoints.

Parallelism is applied to a ``HybridLM`` from outside; the model files keep the architecture only.

* ``mesh.py``: ``ParallelConfig`` (``--dp``, ``--ep``, ``--cp``), ``init_parallel`` -> ``ParallelState``;
* ``parallelize.py``: ``parallelize(model, state)`` (FSDP2 per decoder layer, expert parallelism),
  gradient sync once per step, ``clip_grad_norm`` over shards;
* ``expert_parallel.py``: the all-to-all token dispatch of the MoE layers;
* ``context_parallel.py``: Ulysses context parallelism, each microbatch's rows split over the
  ``cp`` ranks with all-to-alls around every token mixer;
* ``checkpoint.py``: sharded, resumable checkpoints (``save_checkpoint``, ``load_checkpoint``).
"""

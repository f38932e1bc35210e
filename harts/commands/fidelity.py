"""``harts fidelity``: the paper's replay ablation (§5.4, Table 5 and Figure 4) on any model and batch.

One step of the workload is planned into microbatches (``plan_step``, capacity ``--capacity``);
up to ``--microbatches`` of them (every depth bucket covered first) run through Baseline A
(trajectory-wise), Baseline B (trajectory-wise again: the rerun noise), harts Replay (compact)
and No-replay (compact, ``no_replay=True``), without and with recomputation. Prints per
state-handoff depth the token counts, mean symmetric KL (Eq. 25), mean |delta NLL| (Eq. 26) and
their ratios to Baseline B, then Table 5 (mean logit cosine, Eq. 27), loss differences and
parameter-gradient cosines; ``--json`` writes everything, ``--plot`` draws Figure 4.
"""

from __future__ import annotations

import argparse
from typing import Any

from harts.commands._inputs import add_model_arguments, add_option, add_output_arguments, nonneg_int, positive_int
from harts.commands._memory import add_force_argument

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Replay vs no-replay vs trajectory-wise reruns by state-handoff depth (paper Table 5, Figure 4)."

#: --recompute choice -> the recomputation settings run
_SETTINGS = {"both": (False, True), "off": (False,), "on": (True,)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_option(p, "workload", default="small")
    p.add_argument("--step", type=nonneg_int, default=0, help="workload step (built-in presets)")
    add_option(p, "seed")
    add_option(p, "capacity", default=8192, help="microbatch capacity T (compact tokens)")
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="run at most this many microbatches, every depth bucket covered first (default: all)",
    )
    p.add_argument("--max-depth", type=positive_int, default=6, help="last depth bucket (it holds d >= this)")
    add_model_arguments(p, default_dtype="float64")
    add_force_argument(p)
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="a preset model's vocabulary when larger than the batch needs (ling3_tiny's is 157184: "
        "the paper's full-vocabulary KL); default: what the batch needs",
    )
    p.add_argument(
        "--recompute",
        choices=sorted(_SETTINGS),
        default="both",
        help="full-layer activation recomputation: run without it, with it, or both",
    )
    add_option(
        p,
        "attention",
        help="full attention of every path (mask on CUDA / gather on CPU for auto, default)",
    )
    p.add_argument(
        "--logit-chunk",
        type=positive_int,
        default=1024,
        help="positions per full-vocabulary logit block (memory: a few blocks of this x V float32)",
    )
    p.add_argument(
        "--old-logprobs",
        default="baseline",
        choices=["baseline", "batch"],
        help="old log-probs of the GRPO loss: Baseline A's own (on-policy: every action token has gradient "
        "and the loss difference follows the log-prob difference; default) or the batch's",
    )
    p.add_argument(
        "--reference-dtype",
        default=None,
        choices=["float32", "float64"],
        help="also compare every path with Baseline A run on a copy of the weights in this dtype: the "
        "noise floor when reruns are bit-identical (err(Replay) vs err(Baseline A), both against it)",
    )
    p.add_argument(
        "--plot", default=None, metavar="FILE", help="draw Figure 4 (the first setting) here (.png, .pdf or .svg)"
    )
    add_output_arguments(p, what="the results")


def _sci(v: float) -> str:
    return "nan" if v != v else f"{v:.3e}"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


#: table column letter of each path
_LETTER = {"baseline_a": "A", "baseline_b": "B", "replay": "R", "no_replay": "N"}


def _depth_table(d: dict, key: str) -> str:
    """One row per non-empty bucket of a ``measure`` depth record: each path's mean |dNLL| and
    SymKL, Replay's and No-replay's ratios to the noise path, Replay's mean cosine."""
    from harts.commands._table import format_table

    m = d["mean"]
    (ratio_key,) = (k for k in d if k.startswith("ratio_to_"))
    ratio, noise = d[ratio_key], _LETTER[ratio_key.removeprefix("ratio_to_")]
    paths = list(m)
    rows = [
        [
            label,
            d["tokens"][i],
            *(_sci(m[p]["abs_dnll"][i]) for p in paths),
            _ratio(ratio["replay"]["abs_dnll"][i]),
            _ratio(ratio["no_replay"]["abs_dnll"][i]),
            *(_sci(m[p]["sym_kl"][i]) for p in paths),
            f"{m['replay']['cos'][i]:.8f}",
        ]
        for i, label in enumerate(d["buckets"])
        if d["tokens"][i]
    ]
    headers = [key, "tokens", *(f"|dNLL| {_LETTER[p]}" for p in paths), f"R/{noise}", f"N/{noise}"]
    headers += [*(f"SymKL {_LETTER[p]}" for p in paths), "cos R"]
    return format_table(headers, rows)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from harts.commands._inputs import (
        batch_vocab,
        build_model,
        check_capacity,
        model_spec,
        summarize,
    )
    from harts.commands._memory import check_memory
    from harts.commands._progress import progress
    from harts.models.execution.config import ExecutionConfig
    from harts.outputs import PLOT_FORMATS, check_output_file, write_json
    from harts.plan.calls import plan_calls_many
    from harts.plan.depth import handoff_depth
    from harts.plan.step import plan_step
    from harts.rl.fidelity_ablation import PATHS, choose_microbatches, measure, plot_depth
    from harts.tree.workloads import load_workload

    check_output_file(args.json_out, "--json", args.overwrite)
    check_output_file(args.plot, "--plot", args.overwrite, formats=PLOT_FORMATS)
    batch = load_workload(args.workload, step=args.step, seed=args.seed)
    summary = summarize(args.step, args.workload, batch)
    check_capacity([summary], args.capacity)
    vocab, where = batch_vocab([summary], args.model)
    vocab = max(vocab, args.vocab_size or 0)
    check_memory(
        model_spec(args),
        vocab,
        capacity=args.capacity,
        optimizer=False,
        force=args.force,
        where=where,
        compression=summary.tokens / max(1, summary.compact_tokens),
    )
    model = build_model(args, vocab, where=where, training=False)
    base = ExecutionConfig(attention=args.attention, linear_attention_backend=args.la_backend)
    reference = None
    if args.reference_dtype is not None:
        import copy

        import torch

        reference = copy.deepcopy(model).to(getattr(torch, args.reference_dtype))

    step_plan = plan_step(batch, dp=1, capacity=args.capacity)
    cbs = [step_plan.compact_microbatch(k) for k in range(step_plan.num_microbatches)]
    chosen = choose_microbatches([handoff_depth(cb) for cb in cbs], args.microbatches, args.max_depth)
    cbs = [cbs[k] for k in chosen]
    plans = plan_calls_many([cb.segment_trees for cb in cbs], model.config.chunk_size)
    settings = _SETTINGS[args.recompute]
    per_setting = len(PATHS) + (reference is not None)
    bar = progress(len(cbs) * len(settings) * per_setting, "fidelity", "path")

    def on_path(name: str) -> None:
        bar.set_postfix_str(name, refresh=False)
        bar.update()

    record = measure(
        model,
        list(zip(cbs, plans)),
        base,
        recompute=settings,
        max_depth=args.max_depth,
        chunk_rows=args.logit_chunk,
        on_path=on_path,
        old_logprobs=args.old_logprobs,
        reference=reference,
    )
    bar.close()
    _report(args, batch, step_plan.num_microbatches, chosen, model, record)
    config = model.config
    if args.json_out:
        out = {
            "workload": args.workload,
            "step": args.step,
            "seed": args.seed,
            "capacity": args.capacity,
            "microbatch_ids": chosen,
            "model": args.model,
            "config": config.to_dict(),
            "dtype": args.dtype,
            "attention": args.attention,
            "la_backend": args.la_backend,
            "device": args.device,
            "old_logprobs": args.old_logprobs,
            "reference_dtype": args.reference_dtype,
            **record,
        }
        write_json(args.json_out, out, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
        print(f"wrote {args.json_out}")
    if args.plot:
        setting = next(iter(record["settings"]))
        plot_depth(record, setting, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _report(
    args: argparse.Namespace,
    batch: Any,
    num_microbatches: int,
    chosen: list[int],
    model: Any,
    record: dict,  # noqa: ANN401
) -> None:
    """The batch, model and microbatch lines, then per recompute setting the error tables."""
    import numpy as np

    from harts.commands._table import format_table
    from harts.rl.fidelity_ablation import PATHS

    config = model.config
    print(
        f"batch {args.workload}[{args.step}]: {batch.num_trajectories} trajectories, {batch.num_tokens:,} tokens, "
        f"{num_microbatches} microbatches at capacity {args.capacity:,}; ran {len(chosen)} (plan order {chosen})"
    )
    print(
        f"model {args.model} ({config.layer_pattern}, {model.num_parameters():,} params, vocab {config.vocab_size:,}, "
        f"{args.dtype}), attention={args.attention}, la_backend={args.la_backend}, device={args.device}"
    )
    mbs = record["microbatches"]
    print(
        "microbatches: "
        + "; ".join(
            f"S={m['S']:,} C={m['C']:,} calls {m['calls']} (no-replay {m['calls_no_replay']}), "
            f"{m['replay_rows']:,} replay rows"
            for m in mbs
        )
    )
    for setting, rec in record["settings"].items():
        print(f"\n{setting}: errors against Baseline A by state-handoff depth d (R/B, N/B: '-' where B equals A)")
        print(_depth_table(rec["handoff_depth"], "d"))
        print(f"\n{setting}: the same by states imported from another sequence (the handoffs replay changes)")
        print(_depth_table(rec["imported_states"], "imports"))
        if "vs_reference" in rec:
            print(
                f"\n{setting}: every path against Baseline A in {args.reference_dtype} "
                "(R/A, N/A: each path's error over Baseline A's own)"
            )
            print(_depth_table(rec["vs_reference"]["handoff_depth"], "d"))
            cos = rec["vs_reference"]["mean_cos"]
            print("MeanCos vs reference: " + ", ".join(f"{p} {c:.8f}" for p, c in cos.items()))
        print(f"\n{setting}: Table 5 (mean logit cosine, Eq. 27), loss and gradients against Baseline A")
        print(
            format_table(
                ["path", "MeanCos", "max |loss - loss_A|", "grad cos min", "grad cos median"],
                [
                    [
                        p,
                        f"{rec['mean_cos'][p]:.8f}",
                        _sci(float(np.max(rec["loss"]["abs_diff"][p]))),
                        f"{rec['gradient_cos'][p]['min']:.8f}",
                        f"{rec['gradient_cos'][p]['median']:.8f}",
                    ]
                    for p in PATHS[1:]
                ],
            )
        )

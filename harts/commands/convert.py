"""``harts convert PATH``: check that a transformers checkpoint loads into harts.

Reads config.json and the safetensors headers only (no tensor data): prints the
architecture, the harts layer pattern, the parameter count and whether every on-disk tensor
maps onto a harts parameter (and every harts parameter is found). Exit status 0 when the
checkpoint converts completely, 1 otherwise.
"""

from __future__ import annotations

import argparse

from harts.commands._inputs import add_output_arguments, nonneg_int

#: every user error here is a harts.errors.UserError (see harts.cli)
TYPED_ERRORS = True

HELP = "Report architecture, layer pattern, parameters and tensor coverage of a transformers checkpoint."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="local checkpoint directory (config.json + safetensors, sharded or not)")
    add_output_arguments(p, what="the report")
    p.add_argument("--show", type=nonneg_int, default=10, help="how many missing/unmapped names to list")


def run(args: argparse.Namespace) -> int:
    import os

    from harts.commands._inputs import check_output_file, checkpoint_errors, write_json
    from harts.errors import UserError
    from harts.integrations.hf import inspect_checkpoint
    from harts.integrations.hf.checkpoint import UnreadableFileError

    check_output_file(args.json_out, "--json", args.overwrite)
    if not os.path.isdir(args.path):
        what = "is a file" if os.path.exists(args.path) else "does not exist"
        raise UserError(f"{args.path} {what}; give a checkpoint directory (config.json + *.safetensors)")
    try:
        rep = inspect_checkpoint(args.path)
    except checkpoint_errors() as err:
        if isinstance(err, UserError) and not isinstance(err, UnreadableFileError):
            raise
        raise UserError(f"{args.path}: not a readable checkpoint ({err})") from None
    print(f"checkpoint     {rep.path}")
    print(f"architecture   {rep.architecture} (model_type {rep.model_type})")
    if rep.config_error is not None:
        print(f"config         NOT SUPPORTED\n{rep.config_error}")
    else:
        cfg = rep.config
        print(f"layer pattern  {rep.layer_pattern}  ({len(rep.layer_pattern)} layers)")
        ffn = (
            "dense"
            if not cfg["num_experts"]
            else (
                f"{cfg['first_k_dense_replace']} dense, then MoE {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']}"
            )
        )
        print(f"ffn            {ffn}")
        print(f"parameters     {rep.num_parameters:,}")
    print(
        f"tensors        {rep.mapped_tensors:,} of {rep.num_disk_tensors:,} on disk mapped, {len(rep.ignored):,} ignored"
    )
    listed = (
        ("ignored", rep.ignored),
        ("missing", rep.missing),
        ("unmapped", rep.unmapped),
        ("mismatch", rep.mismatched),
    )
    for label, names in listed:
        for n in names[: args.show]:
            print(f"  {label:9s} {n}")
        if len(names) > args.show:
            print(f"  {label:9s} ... {len(names) - args.show} more")
    print(f"all mapped     {'yes' if rep.all_mapped else 'NO'}")
    if args.json_out:
        write_json(args.json_out, rep.to_dict(), default=str)
        print(f"wrote {args.json_out}")
    return 0 if rep.all_mapped else 1

"""Pinned Triton configs for fla-core's kernels: no autotuning on a fresh machine.

fla-core autotunes each kernel over up to a dozen configs the first time it sees a key
(head counts and dims, chunk size, dtypes): minutes of a fresh machine's first training step. fla can instead read the chosen configs from JSON files
(``FLA_CACHE_MODE`` / ``FLA_CONFIG_DIR``, read when fla is imported). harts ships the configs
that fla's own autotuner picked on the GPUs listed under ``fla_configs/<GPU name>/`` and points
fla at them before fla is imported, unless the user set ``FLA_CONFIG_DIR`` or
``FLA_CACHE_MODE`` themselves, or set ``HARTS_FLA_AUTOTUNE=1`` to autotune as usual.

Mode "full": an exact key match, else a key of the same structure (numeric values such as
head dims may differ), else the kernel's default config (the config chosen most often).
Kernels without a file autotune as before. Two files were written by hand, not by fla's
autotuner: KDA's fused gate (``kda_gate_fwd_kernel`` / ``kda_gate_bwd_kernel``, a bandwidth-bound
elementwise pass each way; their JSON says so in ``chosen_by``), pinned so that a fresh
machine does not compile two dozen variants of it; ``tune_fla`` below replaces them.

Regenerate on a new GPU or fla/Triton version::

    python -m benchmarks.ops.tune_fla --out harts/ops/linear_attn/fla_configs

which runs fla's KDA kernels forward and backward on ling3_tiny's shapes (autotuning them)
and writes one ``<kernel>.json`` per autotuned kernel via ``dump_fla_autotune``. What a new
set changes against another (one line per kernel and key)::

    python -m harts.ops.linear_attn.fla_configs diff OLD_DIR NEW_DIR
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

from harts.ops.compiled import env_opt_in

__all__ = [
    "CONFIG_ROOT",
    "config_changes",
    "configure_fla_cache",
    "dump_fla_autotune",
    "fla_autotune_asked",
    "gpu_dir_name",
]

CONFIG_ROOT = Path(__file__).with_name("fla_configs")


def gpu_dir_name(device_name: str) -> str:
    """fla's sanitized GPU name (``NVIDIA H200`` -> ``NVIDIA_H200``)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", device_name).strip("_") or "unknown_gpu"


def fla_autotune_asked() -> bool:
    """``HARTS_FLA_AUTOTUNE=1``: leave fla-core's autotuning on; raises ``ValueError`` for a value
    other than 0, 1 or unset (``env_opt_in``)."""
    return env_opt_in("HARTS_FLA_AUTOTUNE")


def configure_fla_cache() -> str | None:
    """Point fla at harts' pinned configs for this GPU; call before fla is first imported.

    Returns the directory used, or None when the user's settings, ``HARTS_FLA_AUTOTUNE=1``,
    a missing GPU or a GPU without shipped configs leave fla's autotuning on.
    """
    if fla_autotune_asked():
        return None
    if "FLA_CONFIG_DIR" in os.environ or "FLA_CACHE_MODE" in os.environ:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    d = CONFIG_ROOT / gpu_dir_name(torch.cuda.get_device_name(0))
    if not d.is_dir():
        return None
    os.environ["FLA_CONFIG_DIR"] = str(d)
    os.environ["FLA_CACHE_MODE"] = "full"
    return str(d)


def dump_fla_autotune(out_dir: str | os.PathLike) -> list[str]:
    """Write the configs every autotuned fla kernel of this process chose, one JSON file per
    kernel in fla's config-file format; returns the kernel names written."""
    import gc
    import warnings

    import triton
    from fla.ops.utils.cache import AutotuneKey
    from triton.runtime.autotuner import Autotuner

    os.makedirs(out_dir, exist_ok=True)
    written = []
    with warnings.catch_warnings():  # isinstance on some gc objects warns (deprecated proxies)
        warnings.simplefilter("ignore")
        tuners = [obj for obj in gc.get_objects() if isinstance(obj, Autotuner) and obj.cache]
    for obj in tuners:
        fn = obj.fn
        while hasattr(fn, "fn"):  # heuristics -> JITFunction -> the Python function
            fn = fn.fn
        if not str(getattr(fn, "__module__", "")).startswith("fla."):
            continue
        name = getattr(obj, "kernel_name", None) or fn.__name__
        entries = {}
        chosen: Counter[str] = Counter()
        for key, cfg in obj.cache.items():
            config = {
                "kwargs": dict(cfg.kwargs),
                "num_warps": cfg.num_warps,
                "num_stages": cfg.num_stages,
                "num_ctas": getattr(cfg, "num_ctas", 1),
                "maxnreg": getattr(cfg, "maxnreg", None),
            }
            norm = AutotuneKey.normalize_autotune_key(tuple(key))
            entries[AutotuneKey.key_hash(tuple(key))] = {"autotune_key": norm, "config": config}
            chosen[json.dumps(config, sort_keys=True)] += 1
        default = json.loads(chosen.most_common(1)[0][0])
        with open(os.path.join(out_dir, f"{name}.json"), "w") as fh:
            json.dump(
                {
                    "kernel_name": name,
                    "triton_version": triton.__version__,
                    "autotune_entries": entries,
                    "default_config": default,
                },
                fh,
                indent=1,
                sort_keys=True,
            )
        written.append(name)
    return sorted(written)


def _configs(d: Path) -> dict[str, dict[str, dict]]:
    """{kernel: {key text: config}} of the JSON files in ``d`` ("default" for the default)."""
    out: dict[str, dict[str, dict]] = {}
    for f in sorted(Path(d).glob("*.json")):
        try:
            data = json.loads(f.read_text())
            per = {json.dumps(e["autotune_key"]): e["config"] for e in data.get("autotune_entries", {}).values()}
            per["default"] = data.get("default_config", {})
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{f}: not an fla config file ({type(e).__name__}: {e})") from None
        out[f.stem] = per
    return out


def config_changes(old_dir: str | os.PathLike, new_dir: str | os.PathLike) -> list[str]:
    """One line per kernel and autotune key whose config differs between two config
    directories (a kernel or key only one side has is listed too); [] when they agree."""

    def words(c: dict | None) -> str:
        if c is None:
            return "none"
        kw = " ".join(f"{k}={v}" for k, v in sorted(c.get("kwargs", {}).items()))
        return f"{kw} warps={c.get('num_warps')} stages={c.get('num_stages')}".strip()

    old, new = _configs(Path(old_dir)), _configs(Path(new_dir))
    lines = []
    for kernel in sorted(set(old) | set(new)):
        a, b = old.get(kernel, {}), new.get(kernel, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                lines.append(f"{kernel} [{key}]: {words(a.get(key))} -> {words(b.get(key))}")
    return lines


def _main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m harts.ops.linear_attn.fla_configs")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("diff", help="list the configs that differ between two config directories")
    d.add_argument("old")
    d.add_argument("new")
    args = p.parse_args(argv)
    for name in (args.old, args.new):
        if not Path(name).is_dir():
            p.error(f"not a directory: {name}")
    try:
        lines = config_changes(args.old, args.new)
    except ValueError as e:
        p.error(str(e))
    print("\n".join(lines) if lines else "no config differs")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

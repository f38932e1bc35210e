"""Public entry points: transformers models and checkpoints <-> ``HybridLM``.

    from_hf(hf_model, **overrides) -> HybridLM            an instantiated transformers model
    from_pretrained(path, **overrides) -> HybridLM        a local config.json + safetensors directory
    to_hf_state_dict(model) -> dict[str, Tensor]          transformers module names and layouts
    save_hf_checkpoint(model, path)                       config.json + safetensors transformers loads
    inspect_checkpoint(path) -> ConversionReport          names/shapes only (``harts convert``)

``overrides`` may set harts-only fields (``chunk_size``, ``dtype``, router loss coefficients);
architecture fields always come from the checkpoint. The source config (a plain dict) travels
with the model as ``model.hf_source`` so ``save_hf_checkpoint`` can write it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from harts.errors import UserError
from harts.integrations.hf.base import HFAdapter, TensorGroup, UnsupportedConfigError
from harts.models.config import HybridConfig

if TYPE_CHECKING:  # imported lazily at run time (the model imports torch layers)
    from harts.integrations.hf.checkpoint import CheckpointFiles, Source
    from harts.models.hybrid_lm import HybridLM

__all__ = [
    "ADAPTERS",
    "ConversionReport",
    "adapter_for",
    "from_hf",
    "from_pretrained",
    "hf_config_from_dict",
    "inspect_checkpoint",
    "pretrained_config",
    "read_pretrained",
    "save_hf_checkpoint",
    "shape_mismatches",
    "to_hf_state_dict",
]


def _adapters() -> dict[str, HFAdapter]:
    from harts.integrations.hf.bailing_hybrid import BailingHybridAdapter
    from harts.integrations.hf.granitemoehybrid import GraniteMoeHybridAdapter
    from harts.integrations.hf.kimi_linear import KimiLinearAdapter
    from harts.integrations.hf.nemotron_h import NemotronHAdapter
    from harts.integrations.hf.qwen3_5 import QWEN3_5_ADAPTERS
    from harts.integrations.hf.qwen3_next import Qwen3NextAdapter

    adapters = (
        BailingHybridAdapter(),
        Qwen3NextAdapter(),
        KimiLinearAdapter(),
        *QWEN3_5_ADAPTERS,
        NemotronHAdapter(),
        GraniteMoeHybridAdapter(),
    )
    return {a.model_type: a for a in adapters}


ADAPTERS: dict[str, HFAdapter] = _adapters()


def adapter_for(model_type: str) -> HFAdapter:
    if model_type not in ADAPTERS:
        raise UserError(f"unsupported model_type {model_type!r}; harts converts {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[model_type]


#: how transformers' ``save_pretrained`` writes the floats JSON has no literal for
_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_floats(value: Any) -> Any:  # noqa: ANN401 - any JSON value
    """``value`` with transformers' tagged floats (``{"__float__": "Infinity"}``, Nemotron-H's
    ``time_step_limit``) decoded, as its ``from_pretrained`` decodes them."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value["__float__"]]
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def hf_config_from_dict(config: dict[str, Any], where: str = "config.json") -> Any:
    """A transformers config object from a config.json dict (transformers derives defaults).

    ``UserError`` naming ``where`` (the file) for a missing ``model_type``, an unsupported one, a
    field the architecture needs spelled out, or a value transformers' validation rejects."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if model_type is None:
        raise UserError(f"{where}: no model_type; harts converts {', '.join(sorted(ADAPTERS))}")
    adapter = adapter_for(str(model_type))
    missing = adapter.missing_config_fields(config)
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)} ({adapter.architecture} needs them)")
    try:
        return CONFIG_MAPPING[model_type].from_dict(_special_floats(dict(config)))
    except Exception as err:  # transformers' strict validation raises its own exception types
        raise UserError(f"{where}: {' '.join(str(err).split())}") from None


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
    if dtype not in names:
        raise UserError(f"dtype {dtype}: harts models run in float32, float64 or bfloat16; pass dtype=...")
    return names[dtype]


def _to_harts(
    adapter: HFAdapter, cfg: HybridConfig, canonical: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(harts state dict, missing canonical names, unused canonical names)."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set(adapter.ignored_hf_names(cfg))
    missing: list[str] = []
    for g in adapter.tensor_groups(cfg):
        absent = [n for n in g.hf if n not in canonical]
        if absent:
            missing += absent
            continue
        used.update(g.hf)
        for name, t in zip(g.harts, g.convert_to_harts([canonical[n] for n in g.hf])):
            out[name] = t
    return out, missing, sorted(set(canonical) - used)


def _build(cfg: HybridConfig, sd: dict[str, torch.Tensor], device: str | torch.device | None) -> HybridLM:
    from harts.models.hybrid_lm import HybridLM

    with torch.device(device or "cpu"):
        model = HybridLM(cfg)
    dtype = cfg.torch_dtype()
    result = model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"converted state dict does not fit HybridLM: missing {result.missing_keys[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}"
        )
    return model


def _unmapped_error(arch: str, missing: list[str], unused: list[str]) -> UserError:
    parts = []
    if missing:
        parts.append(f"missing tensors {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if unused:
        parts.append(f"unmapped tensors {unused[:10]}{' ...' if len(unused) > 10 else ''}")
    return UserError(f"{arch}: " + "; ".join(parts))


def from_hf(hf_model: Any, *, device: str | torch.device | None = None, **overrides: Any) -> Any:
    """A ``HybridLM`` with the weights of an instantiated transformers model (same semantics)."""
    hf_cfg = hf_model.config
    adapter = adapter_for(getattr(hf_cfg, "model_type", ""))
    overrides.setdefault("dtype", _dtype_name(hf_model.get_input_embeddings().weight.dtype))
    cfg = adapter.config_from_hf(hf_cfg, **overrides)
    canonical = adapter.canonical_state_dict(hf_model)
    sd, missing, unused = _to_harts(adapter, cfg, canonical)
    if missing or unused:
        raise _unmapped_error(adapter.architecture, missing, unused)
    model = _build(cfg, sd, device)
    model.hf_source = _keep_vision(adapter, adapter.hf_source(hf_cfg), hf_model=hf_model)
    return model


def _keep_vision(adapter: HFAdapter, source: dict[str, Any], **where: Any) -> dict[str, Any]:
    """``source`` with where a VL model's vision tower is, for the export to write it back
    (``Qwen3_5Adapter.keep_vision``); other architectures have none."""
    from harts.integrations.hf.qwen3_5 import Qwen3_5Adapter

    return adapter.keep_vision(source, **where) if isinstance(adapter, Qwen3_5Adapter) else source


def shape_mismatches(adapter: HFAdapter, cfg: HybridConfig, sources: dict[str, Source]) -> list[str]:
    """On-disk tensors (``plan_sources``) whose shapes differ from what ``cfg`` gives (the model
    built on the meta device, converted to transformers' layout): one line each, naming the
    on-disk tensor, its shape and the expected one."""
    from harts.models.hybrid_lm import HybridLM

    with torch.device("meta"):
        sd = HybridLM(cfg).state_dict()
    out = []
    for g in adapter.tensor_groups(cfg):
        if not all(n in sd for n in g.harts) or not all(n in sources for n in g.hf):
            continue
        for name, want in zip(g.hf, g.convert_to_hf([sd[n] for n in g.harts])):
            src = sources[name]
            if tuple(src.shape) == tuple(want.shape):
                continue
            if src.kind == "single":
                out.append(f"{src.names[0]} {list(src.shape)} on disk, {list(want.shape)} from config.json")
            else:
                out.append(
                    f"{name} {list(src.shape)} as assembled from {src.names[0]} and {len(src.names) - 1} more, "
                    f"{list(want.shape)} from config.json"
                )
    return out


def _check_shapes(path: str, adapter: HFAdapter, hf_cfg: Any, sources: dict[str, Source]) -> None:
    bad = shape_mismatches(adapter, adapter.config_from_hf(hf_cfg, dtype="float32"), sources)
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise UserError(f"{path}: weights disagree with config.json: {'; '.join(bad[:3])}{more}")


def _open_config(path: str) -> tuple[CheckpointFiles, Any, HFAdapter]:
    """(checkpoint files, transformers config, adapter) of a checkpoint directory."""
    import os

    from harts.integrations.hf.checkpoint import open_checkpoint

    ck = open_checkpoint(path)
    hf_cfg = hf_config_from_dict(ck.config, os.path.join(path, "config.json"))
    return ck, hf_cfg, adapter_for(hf_cfg.model_type)


def _load_canonical(path: str) -> tuple[HFAdapter, Any, dict[str, torch.Tensor], list[str]]:
    from harts.integrations.hf.checkpoint import materialize, plan_sources

    ck, hf_cfg, adapter = _open_config(path)
    sources, ignored, bad = plan_sources(adapter, ck.shapes, adapter.num_hidden_layers_on_disk(hf_cfg))
    if bad:
        raise UserError(f"{path}: {adapter.architecture}: incomplete tensor families on disk: {bad[:10]}")
    _check_shapes(path, adapter, hf_cfg, sources)
    adapter.report_left_out(ignored)
    raw = ck.read(sorted({n for s in sources.values() for n in s.names}))
    canonical = {k: materialize(s, raw) for k, s in sources.items()}
    return adapter, hf_cfg, canonical, ignored


_DISK_DTYPES = {"F32": "float32", "F64": "float64", "BF16": "bfloat16"}


def pretrained_config(path: str, **overrides: Any) -> tuple[HybridConfig, dict[str, Any]]:
    """(config, ``hf_source``) of a checkpoint directory, read from ``config.json`` and the
    safetensors headers only (no tensor data): enough to build the model on the meta device.
    Equals what ``read_pretrained`` returns for the same ``overrides``."""
    from safetensors import safe_open

    from harts.integrations.hf.checkpoint import plan_sources

    ck, hf_cfg, adapter = _open_config(path)
    sources, _, _ = plan_sources(adapter, ck.shapes, adapter.num_hidden_layers_on_disk(hf_cfg))
    _check_shapes(path, adapter, hf_cfg, sources)
    if "dtype" not in overrides:
        emb = sources.get("model.embed_tokens.weight")
        overrides["dtype"] = "float32"
        if emb is not None:
            with safe_open(ck.files[emb.names[0]], framework="pt") as fh:
                disk = fh.get_slice(emb.names[0]).get_dtype()
            if disk not in _DISK_DTYPES:
                raise UserError(f"dtype {disk}: harts models run in float32, float64 or bfloat16; pass dtype=...")
            overrides["dtype"] = _DISK_DTYPES[disk]
    cfg = adapter.config_from_hf(hf_cfg, **overrides)
    return cfg, _keep_vision(adapter, adapter.hf_source(hf_cfg), checkpoint=path)


def read_pretrained(path: str, **overrides: Any) -> tuple[HybridConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """(config, full harts state dict on the host in the config's dtype, ``hf_source``) of a
    local transformers checkpoint directory: what ``from_pretrained`` builds a model from, and
    what rank 0 broadcasts to a model sharded over ranks (``harts.parallel.build``)."""
    adapter, hf_cfg, canonical, _ = _load_canonical(path)
    if "dtype" not in overrides:
        emb = canonical.get("model.embed_tokens.weight")
        overrides["dtype"] = _dtype_name(emb.dtype) if emb is not None else "float32"
    cfg = adapter.config_from_hf(hf_cfg, **overrides)
    sd, missing, unused = _to_harts(adapter, cfg, canonical)
    del canonical
    if missing or unused:
        raise _unmapped_error(adapter.architecture, missing, unused)
    dtype = cfg.torch_dtype()
    for k in list(sd):  # one at a time: each original is freed as its converted copy replaces it
        sd[k] = sd[k].to(dtype)
    return cfg, sd, _keep_vision(adapter, adapter.hf_source(hf_cfg), checkpoint=path)


def from_pretrained(path: str, *, device: str | torch.device | None = None, **overrides: Any) -> Any:
    """A ``HybridLM`` from a local transformers checkpoint directory (sharded or single file)."""
    cfg, sd, source = read_pretrained(path, **overrides)
    model = _build(cfg, sd, device)
    model.hf_source = source
    return model


def to_hf_state_dict(model: HybridLM, *, model_type: str | None = None) -> dict[str, torch.Tensor]:
    """transformers module state dict (names and layouts) for ``model``'s current weights.

    ``model_type`` defaults to the architecture the model was loaded from; a harts-native
    model must name one (and its HybridConfig must be expressible in that architecture).
    """
    source = getattr(model, "hf_source", None)
    model_type = model_type or (source or {}).get("model_type")
    if model_type is None:
        raise ValueError("to_hf_state_dict: the model was not loaded from transformers; pass model_type=...")
    adapter = adapter_for(model_type)
    cfg: HybridConfig = model.config
    sd = {k: _full_tensor(v.detach()) for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    groups: list[TensorGroup] = adapter.tensor_groups(cfg)
    covered: set[str] = set()
    for g in groups:
        absent = [n for n in g.harts if n not in sd]
        if absent:
            raise ValueError(f"to_hf_state_dict({model_type}): model lacks {absent} (config not expressible)")
        covered.update(g.harts)
        out.update(zip(g.hf, g.convert_to_hf([sd[n] for n in g.harts])))
    left = sorted(set(sd) - covered)
    if left:
        raise ValueError(f"to_hf_state_dict({model_type}): harts tensors with no transformers counterpart: {left[:10]}")
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded parameter (FSDP2 / expert-parallel DTensor) gathered to its full value; every rank
    of its mesh must call this (collective)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def save_hf_checkpoint(
    model: Any, path: str, *, hf_config: dict[str, Any] | None = None, max_shard_size: int | None = None
) -> list[str]:
    """Write ``config.json`` + safetensors that ``AutoModelForCausalLM.from_pretrained`` loads
    (a model of a Qwen3.5 VL checkpoint: the VL checkpoint, its vision tower written back
    unchanged; ``hf_config`` given: the language model alone, as that config says).

    Tensors use transformers' module names (which transformers loads as they are).
    ``max_shard_size`` in bytes splits the weights into shards with an index.
    Returns the safetensors file names.

    A model sharded over ranks (``harts.parallel``) is gathered: every rank calls this, rank 0
    writes (the others return ``[]``).
    """
    import json
    import os

    import torch.distributed as dist

    from harts.integrations.hf.checkpoint import write_safetensors
    from harts.integrations.hf.qwen3_5 import Qwen3_5Adapter

    source = getattr(model, "hf_source", None)
    config = dict(hf_config or (source or {}).get("config") or {})
    if not config:
        raise ValueError("save_hf_checkpoint: pass hf_config=... for a model not loaded from transformers")
    adapter = adapter_for(config.get("model_type", ""))
    sd = to_hf_state_dict(model, model_type=adapter.model_type)
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return []
    config["architectures"] = [adapter.architecture]
    config["dtype"] = model.config.dtype
    vision = (source or {}).get("vision") if hf_config is None else None
    if vision is not None:  # a VL model's language model: its vision tower goes back beside it
        vl = adapter_for(vision["model_type"])
        assert isinstance(vl, Qwen3_5Adapter), "only Qwen3.5's VL models carry a vision tower"
        config, sd = vl.vl_checkpoint(config, sd, vision)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2, sort_keys=True, default=str)
    return write_safetensors(sd, path, max_shard_bytes=max_shard_size)


@dataclass
class ConversionReport:
    """What ``harts convert`` prints: checked on names and shapes, no tensor data read."""

    path: str
    model_type: str
    architecture: str
    layer_pattern: str = ""
    num_parameters: int = 0
    num_disk_tensors: int = 0
    mapped_tensors: int = 0
    #: on-disk tensors deliberately skipped (multi-token-prediction layers, tied lm_head, a vision tower)
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)
    #: on-disk tensors whose shape disagrees with config.json (``shape_mismatches``)
    mismatched: list[str] = field(default_factory=list)
    config_error: str | None = None
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def all_mapped(self) -> bool:
        return self.config_error is None and not self.missing and not self.unmapped and not self.mismatched

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["all_mapped"] = self.all_mapped
        return d


def inspect_checkpoint(path: str) -> ConversionReport:
    """Architecture, layer pattern, parameter count and tensor coverage of a checkpoint."""
    from harts.integrations.hf.checkpoint import plan_sources

    ck, hf_cfg, adapter = _open_config(path)
    rep = ConversionReport(
        path=path, model_type=adapter.model_type, architecture=adapter.architecture, num_disk_tensors=len(ck.shapes)
    )
    sources, ignored, bad = plan_sources(adapter, ck.shapes, adapter.num_hidden_layers_on_disk(hf_cfg))
    rep.ignored, rep.unmapped = ignored, list(bad)
    try:
        cfg = adapter.config_from_hf(hf_cfg, dtype="float32")
    except (UnsupportedConfigError, ValueError) as e:
        rep.config_error = str(e)
        return rep
    rep.layer_pattern = cfg.layer_pattern
    rep.config = cfg.to_dict()
    rep.mismatched = shape_mismatches(adapter, cfg, sources)
    used: set[str] = set()
    for g in adapter.tensor_groups(cfg):
        absent = [n for n in g.hf if n not in sources]
        if absent:
            rep.missing += absent
            continue
        used.update(g.hf)
        if not all(h.endswith("e_score_correction_bias") for h in g.harts):  # a buffer, not a parameter
            rep.num_parameters += sum(sources[n].numel for n in g.hf)
    tied = adapter.ignored_hf_names(cfg) & set(sources)
    rep.ignored += sorted(n for t in tied for n in sources[t].names)
    rep.unmapped += sorted(n for k, s in sources.items() if k not in used and k not in tied for n in s.names)
    rep.mapped_tensors = sum(len(sources[k].names) for k in used)
    return rep

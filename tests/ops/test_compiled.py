"""Compiled layer glue: eager on CPU (the reference itself), compiled on CUDA and close to eager."""

from __future__ import annotations

import pytest
import torch

from harts.models.layers.kda import kda_log_decay
from harts.models.layers.mlp import swiglu
from harts.models.layers.moe import _PairsToRows, _RowsToPairs, sum_slots, weighted_swiglu
from harts.models.layers.norms import add_rms_norm, l2norm, rms_norm, rms_norm_gated
from harts.models.layers.rope import apply_rope, mla_key_value, rope_cos_sin
from harts.ops.compiled import compile_enabled, cuda_compiled

F64 = torch.float64


def _cases(T: int, device: str, dtype: torch.dtype, seed: int = 0):  # noqa: ANN202
    """(name, function, args) for every compiled glue function, on rows of length T."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=F64) * scale).to(device, dtype).requires_grad_()

    cos, sin = rope_cos_sin(torch.arange(T, device=device), 64, 10_000.0, dtype)
    slots = torch.randperm(3 * T, generator=g).view(T, 3).to(device)  # each of T*3 rows once
    return [
        ("rms_norm", rms_norm, (r(T, 96), r(96), 1e-6, False)),
        ("rms_norm_unit_offset", rms_norm, (r(T, 96), r(96, scale=0.1), 1e-6, True)),
        ("rms_norm_gated_sigmoid", rms_norm_gated, (r(T, 4, 32), r(T, 4, 32), r(32), 1e-6, "sigmoid")),
        ("rms_norm_gated_silu", rms_norm_gated, (r(T, 4, 32), r(T, 4, 32), r(32), 1e-6, "silu")),
        ("l2norm", l2norm, (r(T, 4, 32),)),
        ("swiglu", swiglu, (r(T, 64), r(T, 64))),
        ("kda_log_decay", kda_log_decay, (r(T, 4, 32), r(4, 32), r(4, scale=0.5), None)),
        ("kda_log_decay_safe", kda_log_decay, (r(T, 4, 32), r(4, 32), r(4, scale=0.5), -5.0)),
        ("apply_rope", apply_rope, (r(T, 4, 96), cos, sin)),
        ("apply_rope_last", _rope_last, (r(T, 4, 96), cos, sin)),
        ("weighted_swiglu", weighted_swiglu, (r(T, 2 * 48), r(T))),
        ("sum_slots", sum_slots, (slots, r(T, 3, 40))),
        ("mla_key_value", _flat(mla_key_value, nope=48), (r(T, 4, 48 + 32), r(T, 1, 64), cos, sin)),
        ("mla_key_value_no_rope", _flat(mla_key_value, nope=48), (r(T, 4, 48 + 32), r(T, 1, 16), None, None)),
        ("add_rms_norm", _flat(add_rms_norm), (r(T, 96), r(T, 96), r(96), 1e-6, False)),
    ]


def _flat(fn, **kw):  # noqa: ANN001, ANN003, ANN202 - a function of several outputs as one tensor
    def run(*args):  # noqa: ANN002, ANN202
        return torch.cat([o.flatten() for o in fn(*args, **kw)])

    run.eager = lambda *args: torch.cat([o.flatten() for o in fn.eager(*args, **kw)])  # type: ignore[attr-defined]
    return run


def _rope_last(x, cos, sin):  # noqa: ANN001, ANN202 - MLA's query: the rotary dims last
    return apply_rope(x, cos, sin, rotary_last=True)


_rope_last.eager = lambda x, cos, sin: apply_rope.eager(x, cos, sin, rotary_last=True)  # type: ignore[attr-defined]


def test_mla_keys_and_values() -> None:
    """Keys: each head's k_nope, then the rows' shared rotary key rotated; values contiguous."""
    t, h, n, v, r = 6, 3, 8, 5, 4
    g = torch.Generator().manual_seed(2)
    kv, k_rot = torch.randn(t, h, n + v, generator=g, dtype=F64), torch.randn(t, 1, r, generator=g, dtype=F64)
    cos, sin = rope_cos_sin(torch.arange(t), r, 10_000.0, F64)
    key, value = mla_key_value(kv, k_rot, cos, sin, nope=n)
    assert key.shape == (t, h, n + r) and torch.equal(key[..., :n], kv[..., :n])
    assert value.is_contiguous() and torch.equal(value, kv[..., n:])
    rotated = apply_rope(k_rot, cos, sin)[:, 0]
    assert all(torch.equal(key[:, i, n:], rotated) for i in range(h))
    assert torch.equal(mla_key_value(kv, k_rot, None, None, nope=n)[0][:, 1, n:], k_rot[:, 0])


def test_row_bounded_tuple_results_are_cut_back() -> None:
    """A row-bounded function returning several row-first tensors: each padded and cut back."""
    from harts.ops.compiled import MIN_ROWS, run_row_bounded

    seen = []

    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(x.shape[0])
        return x * 2, x[:, :1] + 1

    x = torch.randn(5, 3)
    a, b = run_row_bounded(two, (x,), {}, rows=(0,))
    assert seen == [MIN_ROWS] and torch.equal(a, x * 2) and torch.equal(b, x[:, :1] + 1)


def test_rope_on_the_last_dims_equals_split_rotate_concatenate() -> None:
    """``rotary_last`` (MLA's ``[nope | rope]`` query) equals rotating the last R dims' slice and
    concatenating it behind the rest, values and gradients exactly (float64, both pair layouts)."""
    g = torch.Generator().manual_seed(3)
    cos, sin = rope_cos_sin(torch.arange(9), 8, 10_000.0, F64)
    for interleaved in (False, True):
        x = torch.randn(9, 3, 20, dtype=F64, generator=g, requires_grad=True)
        got = apply_rope(x, cos, sin, interleaved=interleaved, rotary_last=True)
        nope, rot = torch.split(x, [12, 8], dim=-1)
        want = torch.cat([nope, apply_rope(rot, cos, sin, interleaved=interleaved)], dim=-1)
        assert torch.equal(got, want)
        up = torch.randn(got.shape, dtype=F64, generator=g)
        (a,) = torch.autograd.grad((got * up).sum(), x)
        (b,) = torch.autograd.grad((want * up).sum(), x)
        assert torch.equal(a, b)
        # only rotary dims: the same as the plain rotation
        assert torch.equal(
            apply_rope(rot, cos, sin, interleaved=interleaved, rotary_last=True),
            apply_rope(rot, cos, sin, interleaved=interleaved),
        )


def _value_and_grads(fn, args):  # noqa: ANN001, ANN202
    out = fn(*args)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    upstream = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    return [out.detach(), *grads]


def test_cpu_runs_the_function_itself() -> None:
    """On CPU the wrapper is the eager function: bit-identical results, float64 included."""
    for name, fn, args in _cases(7, "cpu", F64):
        got, ref = _value_and_grads(fn, args), _value_and_grads(fn.eager, args)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), name


def test_switch_and_eager_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    @cuda_compiled
    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return 2 * x

    assert double.eager(torch.ones(2)).tolist() == [2.0, 2.0]  # type: ignore[attr-defined]
    assert double(torch.ones(2)).tolist() == [2.0, 2.0] and len(calls) == 2
    monkeypatch.delenv("HARTS_COMPILE", raising=False)
    assert compile_enabled()  # on by default (see harts.ops.compiled)
    for off in ("0", "false", "Off", " no "):
        monkeypatch.setenv("HARTS_COMPILE", off)
        assert not compile_enabled()
    for on in ("1", "true", "ON"):
        monkeypatch.setenv("HARTS_COMPILE", on)
        assert compile_enabled()


def test_moe_permutation_functions_gradcheck() -> None:
    """The expert-order gather and the slot sum, with their hand-written backwards (float64)."""
    t, k, d = 5, 3, 4
    g = torch.Generator().manual_seed(1)
    flat = torch.randint(0, 4, (t * k,), generator=g)
    order = torch.argsort(flat, stable=True)
    src = order // k
    back = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    x = torch.randn(t, d, dtype=F64, generator=g, requires_grad=True)
    h = torch.randn(t * k, d, dtype=F64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: _RowsToPairs.apply(x, src, back, k), (x,))
    assert torch.autograd.gradcheck(lambda h: _PairsToRows.apply(h, src, back, k), (h,))
    torch.testing.assert_close(_RowsToPairs.apply(x, src, back, k), x[src])
    torch.testing.assert_close(_PairsToRows.apply(h, src, back, k), h[back].view(t, k, d).sum(1))


def test_failed_compile_falls_back_to_eager_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiler failure on CUDA: warn, run the eager function, and keep it (the compiler is
    replaced and the CUDA check faked, so this runs on CPU)."""
    import harts.ops.compiled as compiled_mod

    compiles = []

    def broken_compile(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202
        compiles.append(kwargs)

        def run(*args):  # noqa: ANN002, ANN202
            raise RuntimeError("no triton here")

        return run

    class FakeCuda(torch.Tensor):
        is_cuda = True  # type: ignore[assignment]

    monkeypatch.setattr(compiled_mod.torch, "compile", broken_compile)
    lse = cuda_compiled(opt_in=False, dynamic=None)(lambda x: torch.logsumexp(x.as_subclass(torch.Tensor), -1))
    x = torch.randn(3, 5).as_subclass(FakeCuda)  # float32 (float64 never compiles)
    with pytest.warns(UserWarning, match="no triton here"):
        got = lse(x)
    torch.testing.assert_close(got.as_subclass(torch.Tensor), torch.logsumexp(x.as_subclass(torch.Tensor), -1))
    lse(x)  # the eager function from now on: no second compile, no second warning
    assert compiles == [{"dynamic": None}]


def test_float64_runs_eagerly_and_integer_arguments_do_not_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Float64 on CUDA is the precision reference and Inductor miscompiles its split reductions:
    never compiled. An integer argument (``sum_slots``' index) does not stop a float32 call from
    compiling (the compiler is replaced and the CUDA check faked, so this runs on CPU)."""
    import harts.ops.compiled as compiled_mod

    compiles = []

    def recording_compile(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202
        compiles.append(fn)
        return fn

    class FakeCuda(torch.Tensor):
        is_cuda = True  # type: ignore[assignment]

    monkeypatch.setattr(compiled_mod.torch, "compile", recording_compile)
    monkeypatch.setenv("HARTS_COMPILE", "1")

    @cuda_compiled(rows=None)
    def scaled_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return x.as_subclass(torch.Tensor)[index.as_subclass(torch.Tensor)] * 2

    index = torch.tensor([2, 0])
    x64 = torch.randn(3, 4, dtype=F64)
    got = scaled_rows(x64.as_subclass(FakeCuda), index)
    assert compiles == [] and torch.equal(got.as_subclass(torch.Tensor), x64[index] * 2)
    assert not compiled_mod.compiles_dtypes((x64, index))
    x32 = x64.float()
    scaled_rows(x32.as_subclass(FakeCuda), index)
    assert len(compiles) == 1 and compiled_mod.compiles_dtypes((x32, index))
    assert compiled_mod.compiles_dtypes((index,)) and compiled_mod.compiles_dtypes((x32.bfloat16(), 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float64_glue_backward_runs_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compiled glue function, forward and backward, in float64 on CUDA: runs (eagerly)
    and equals the eager function bit for bit (torch 2.11's Inductor failed to compile a float64
    norm's backward: ``harts.ops.compiled``)."""
    monkeypatch.setenv("HARTS_COMPILE", "1")
    for name, fn, args in _cases(20_000, "cuda", F64, seed=5):
        got, ref = _value_and_grads(fn, args), _value_and_grads(fn.eager, args)
        for a, b in zip(got, ref):
            assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_compiled_as_close_to_float64_as_eager_on_cuda(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled (Inductor) output and every gradient, against float64 on the same rounded inputs:
    within 2x the eager function's own error (+ a float32-rounding floor), at two row counts
    (dynamic shapes: the second must not need new code to be right)."""
    monkeypatch.setenv("HARTS_COMPILE", "1")
    for T in (333, 1024, 20_000):  # below MIN_ROWS (zero-padded) and above
        for name, fn, args in _cases(T, "cuda", dtype, seed=T):
            args64 = [
                a.detach().double().requires_grad_(a.requires_grad)
                if isinstance(a, torch.Tensor) and a.is_floating_point()
                else a
                for a in args
            ]
            ref = _value_and_grads(fn.eager, args64)
            got, eager = _value_and_grads(fn, args), _value_and_grads(fn.eager, args)
            for i, (a, e, r) in enumerate(zip(got, eager, ref)):
                scale = r.abs().max().clamp_min(1e-30)
                err, err_eager = (
                    ((a.double() - r).abs().max() / scale).item(),
                    ((e.double() - r).abs().max() / scale).item(),
                )
                # a parameter's gradient sums out.numel() / r.numel() terms, which Inductor adds in
                # another order than eager (float32 accumulation: error ~ sqrt(terms) * 2^-24; the
                # A_log gradient of kda_log_decay sums 160 k terms at T = 20,000)
                floor = 1e-5 + 4 * (got[0].numel() / r.numel()) ** 0.5 * 2**-24
                assert err <= 2 * err_eager + floor, f"{name}[{i}] T={T}: compiled {err:.2e} vs eager {err_eager:.2e}"


@pytest.mark.inductor_cpu
def test_row_counts_share_one_compiled_graph() -> None:
    """``run_row_bounded`` with the real compiler (Inductor on CPU): one graph serves every row
    count, 0 and 1 and counts below ``MIN_ROWS`` (zero-padded) included, with values and
    gradients equal to the eager function's. Plain ``dynamic=True`` recompiled on an H200 when
    a smaller microbatch crossed Inductor's size-class guards (``harts.ops.compiled``)."""
    from torch._dynamo.utils import counters

    from harts.ops.compiled import MIN_ROWS, run_row_bounded

    torch._dynamo.reset()
    counters.clear()
    fn = rms_norm_gated.eager
    compiled = torch.compile(fn, dynamic=True)
    w = torch.randn(32, dtype=F64, requires_grad=True)  # float64: the weight gradient sums 16 k+ rows
    for t in (MIN_ROWS + 5, 3, 0, 1, 2 * MIN_ROWS + 17):
        x = torch.randn(t, 2, 32, dtype=F64, requires_grad=True)
        gate = torch.randn(t, 2, 32, dtype=F64, requires_grad=True)
        out = run_row_bounded(compiled, (x, gate, w, 1e-6, "silu"), {}, (0, 1))
        assert out.shape == (t, 2, 32)
        ref = fn(x, gate, w, 1e-6, "silu")
        torch.testing.assert_close(out, ref)
        if t:
            up = torch.randn_like(ref)
            got = torch.autograd.grad((out * up).sum(), (x, gate, w))
            want = torch.autograd.grad((ref * up).sum(), (x, gate, w))
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.inductor_cpu
def test_sum_slots_padded_index_rows() -> None:
    """``sum_slots`` through ``run_row_bounded`` (Inductor on CPU): padded index rows point at row
    0 and are cut off again, so every row count gives the eager sums and gradients, from one graph."""
    from torch._dynamo.utils import counters

    from harts.ops.compiled import MIN_ROWS, run_row_bounded

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(sum_slots.eager, dynamic=True)
    g = torch.Generator().manual_seed(5)
    for t in (MIN_ROWS + 3, 2, 1, 0):
        # not views: a view and a padded copy are two graphs (Dynamo guards on ``_base``), a
        # variant compiled once per process (harts.ops.compiled), not per row count
        index = torch.randperm(4 * t, generator=g).view(t, 4).clone()
        x = torch.randn(t, 4, 8, dtype=F64, generator=g, requires_grad=True)
        out = run_row_bounded(compiled, (index, x), {}, (0, 1))
        ref = x.reshape(-1, 8)[index].sum(1)
        torch.testing.assert_close(out, ref)
        if t:
            up = torch.randn_like(ref)
            (got,) = torch.autograd.grad((out * up).sum(), x)
            (want,) = torch.autograd.grad((ref * up).sum(), x)
            torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] == 1


def test_row_bounded_arguments_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Different row counts are the caller's bug: raised, not taken for a compiler failure (the
    CUDA check is faked and the compiler is never reached, so this runs on CPU)."""
    import harts.ops.compiled as compiled_mod
    from harts.ops.compiled import RowMismatchError, run_row_bounded

    with pytest.raises(RowMismatchError, match="argument 1 has \\(4, 8\\) rows-first, expected 3 rows"):
        run_row_bounded(swiglu.eager, (torch.ones(3, 8), torch.ones(4, 8)), {}, (0, 1))

    class FakeCuda(torch.Tensor):
        is_cuda = True  # type: ignore[assignment]

    monkeypatch.setattr(compiled_mod.torch, "compile", lambda fn, **kw: fn)
    gate, up = torch.ones(3, 8).as_subclass(FakeCuda), torch.ones(4, 8).as_subclass(FakeCuda)
    with pytest.raises(RowMismatchError):
        swiglu(gate, up)


def test_rows_mode_keeps_feature_widths_static() -> None:
    """``HARTS_COMPILE_DYNAMIC=rows`` (the default): ``dynamic=None`` plus ``mark_row_dynamic``
    gives one graph per feature width whose row count alone is symbolic, whatever the row counts
    (below ``MIN_ROWS`` padded); the widths stay concrete even after a second width (no automatic
    dynamic shapes), so Inductor indexes with constants. Values equal the eager function's."""
    from harts.ops.compiled import MIN_ROWS, dynamic_setting, run_row_bounded

    seen: list[list[tuple[bool, ...]]] = []

    def recording_backend(gm, example_inputs):  # noqa: ANN001, ANN202
        shapes = []
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor):
                shapes.append(tuple(not isinstance(d, int) for d in value.shape))
        seen.append(shapes)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(rms_norm_gated.eager, dynamic=None, backend=recording_backend)
    for width in (32, 16):
        w = torch.randn(width, dtype=F64)
        for t in (MIN_ROWS + 5, 3, 2 * MIN_ROWS + 17, MIN_ROWS + 100):
            x, gate = torch.randn(t, 2, width, dtype=F64), torch.randn(t, 2, width, dtype=F64)
            out = run_row_bounded(compiled, (x, gate, w, 1e-6, "silu"), {}, (0, 1), mark=True)
            torch.testing.assert_close(out, rms_norm_gated.eager(x, gate, w, 1e-6, "silu"))
    assert len(seen) == 2  # one graph per width, none per row count
    for shapes in seen:
        # x and gate [T, 2, width]: T symbolic; the weight [width]: static (placeholder order is Dynamo's)
        assert sorted(shapes) == [(False,), (True, False, False), (True, False, False)]
    assert dynamic_setting() == "rows"


def test_dynamic_setting_names_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    from harts.ops.compiled import dynamic_setting

    monkeypatch.setenv("HARTS_COMPILE_DYNAMIC", "all")
    assert dynamic_setting() == "all"
    monkeypatch.setenv("HARTS_COMPILE_DYNAMIC", "some")
    with pytest.raises(ValueError, match="'some'"):
        dynamic_setting()


def test_a_compiler_failure_is_one_line_with_its_chain_and_the_whole_text_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A compiler's failure quotes its command and output (hundreds of lines): the fallback
    warning names each exception of the chain by its first line, within ``SUMMARY_CHARS``; the
    whole text goes to the ``harts`` logger at DEBUG."""
    import logging

    from harts.ops.compiled import SUMMARY_CHARS, failure_summary

    class CppCompileError(RuntimeError):
        pass

    class BackendCompilerFailed(RuntimeError):
        def __init__(self, inner: BaseException) -> None:
            super().__init__("backend='inductor' raised:\n" + str(inner))
            self.inner_exception = inner

    output = "C++ compile error\n\nCommand:\ng++ x.cpp -L/a path/torch/lib\n" + "warning: noise\n" * 500
    output += "/usr/bin/ld: cannot find path/torch/lib: No such file or directory"
    with caplog.at_level(logging.DEBUG, logger="harts"):
        line = failure_summary(BackendCompilerFailed(CppCompileError(output)))
    assert "\n" not in line and len(line) <= SUMMARY_CHARS
    assert line == "BackendCompilerFailed: backend='inductor' raised: <- CppCompileError: C++ compile error"
    assert "cannot find path/torch/lib" in caplog.text  # the whole failure, for whoever asks
    try:
        try:
            raise KeyError("inner")
        except KeyError as err:
            raise ValueError("x" * 1000) from err
    except ValueError as chained:
        long = failure_summary(chained)
    assert len(long) == SUMMARY_CHARS and long.endswith("...") and long.startswith("ValueError: xxx")
    assert failure_summary(RuntimeError()) == "RuntimeError"


def test_the_block_mask_builder_falls_back_with_a_one_line_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import harts.ops.attention.tree_mask as tree_mask

    def broken(kv_block: int = 128):  # noqa: ANN202
        def run(pre: torch.Tensor, end: torch.Tensor) -> None:
            raise RuntimeError("C++ compile error\n" + "noise\n" * 200)

        return run

    monkeypatch.setattr(tree_mask, "_compiled_block_mask", broken)
    pre, end = torch.tensor([0, 1, 2, 3]), torch.tensor([4, 2, 3, 4])
    with pytest.warns(UserWarning) as record:
        mask = tree_mask.tree_block_mask(pre, end)
    (warning,) = [w for w in record if "block-mask builder failed" in str(w.message)]
    text = str(warning.message)
    assert "\n" not in text and len(text) < 400 and "(RuntimeError: C++ compile error)" in text
    assert mask is not None

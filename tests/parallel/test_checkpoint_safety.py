"""Checkpoints cannot be poisoned and name their damage.

* a pickle that would create a file when unpickled, planted into every file slot of a DCP
  checkpoint (``harts.parallel.checkpoint``) and of a trainer state (``harts.trainer.state``), is
  refused with a ``UserError`` and the file is never created;
* every truncated or garbled file is one ``DamagedCheckpoint`` naming it and the previous
  checkpoint, and ``fallback=True`` goes back to that previous one;
* a checkpoint of another model is a ``UserError`` before any weight is read.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from harts.errors import UserError
from harts.parallel.checkpoint import (
    DamagedCheckpoint,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from harts.parallel.dcp_json import METADATA_FILE


class Net(nn.Module):
    """Two layers and a buffer the loop updates (like the MoE expert bias)."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(4, width)
        self.b = nn.Linear(width, 3)
        self.register_buffer("bias", torch.zeros(3), persistent=False)


def make(step: int = 0, width: int = 6) -> tuple[Net, torch.optim.Optimizer]:
    """A net whose parameters and buffer all equal ``step``, with one AdamW update behind it."""
    net = Net(width)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with torch.no_grad():
        for t in [*net.parameters(), *net.buffers()]:
            t.fill_(step)
    return net, opt


def save(run: Path, step: int) -> Path:
    net, opt = make(step)
    extra = {"command": "test", "betas": (0.9, 0.99)}
    data = {"next_step": step, "state": {"sampler": torch.arange(5, dtype=torch.uint8), "history": [{"r": 0.5}]}}
    return save_checkpoint(run, step=step, model=net, optimizer=opt, data_state=data, extra=extra)


def load(where: Path, **kw) -> tuple[Net, object]:  # noqa: ANN003
    net, opt = make(-1)
    return net, load_checkpoint(where, model=net, optimizer=opt, **kw)


@pytest.fixture
def run(tmp_path: Path) -> Path:
    for step in (1, 2):
        save(tmp_path / "run", step)
    return tmp_path / "run"


# ------------------------------------------------------------------------- round trip
def test_round_trip_keeps_weights_buffers_optimizer_and_data(run):
    net, got = load(run)
    assert got.step == 2 and got.path == checkpoint_path(run, 2)
    assert all(torch.equal(t, torch.full_like(t, 2)) for t in [*net.parameters(), *net.buffers()])
    assert got.extra == {"command": "test", "betas": (0.9, 0.99)}  # tuples come back as tuples
    assert torch.equal(got.data_state["state"]["sampler"], torch.arange(5, dtype=torch.uint8))
    assert got.data_state["state"]["history"] == [{"r": 0.5}]
    assert read_checkpoint(checkpoint_path(run, 1)).step == 1
    names = sorted(p.name for p in checkpoint_path(run, 2).iterdir())
    assert names == ["data.safetensors", "dcp", "meta.json", "rng"]
    assert not list(checkpoint_path(run, 2).rglob("*.pt")) and not list(checkpoint_path(run, 2).rglob(".metadata"))


def test_another_model_is_named_before_any_weight_is_read(run):
    net, opt = make(-1, width=7)
    with pytest.raises(UserError, match=r"a.weight was saved as \[6, 4\], this model has \[7, 4\].*harts test"):
        load_checkpoint(run, model=net, optimizer=opt)
    assert all(torch.equal(t, torch.full_like(t, -1)) for t in net.parameters())


# ---------------------------------------------------------------------- planted pickles
def _payload(marker: Path) -> bytes:
    """A pickle whose loading creates ``marker`` (it calls ``open(marker, "w")``)."""

    class Plant:
        def __reduce__(self):  # noqa: ANN204
            return (open, (str(marker), "w"))

    return pickle.dumps(Plant())


def _torch_payload(marker: Path, tmp: Path) -> bytes:
    """The same, as a ``torch.save`` file (what DCP's data files hold, one per tensor)."""

    class Plant:
        def __reduce__(self):  # noqa: ANN204
            return (open, (str(marker), "w"))

    torch.save(Plant(), tmp)
    return tmp.read_bytes()


def test_the_payload_runs_when_unpickled(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(_payload(marker)).close()  # noqa: S301 - proving the payload works
    assert marker.exists()


def _distcp_slot(ckpt: Path, data: bytes) -> None:
    """A well-formed checkpoint whose metadata points a tensor at ``data`` in a new file."""
    dcp_dir = ckpt / "dcp"
    (dcp_dir / "planted.distcp").write_bytes(data)
    md = json.loads((dcp_dir / METADATA_FILE).read_text())
    entry = next(s for s in md["storage"] if s["fqn"] == "model.a.weight")
    entry.update(file="planted.distcp", start=0, length=len(data))
    (dcp_dir / METADATA_FILE).write_text(json.dumps(md))


SLOTS = ["meta.json", "data.safetensors", "rng/rank0.safetensors", f"dcp/{METADATA_FILE}", "dcp/__0_0.distcp"]


@pytest.mark.parametrize("slot", [*SLOTS, "dcp/.metadata", "meta.pt", "distcp-torch-file", "distcp-pickle"])
def test_a_planted_pickle_runs_nothing(run, tmp_path, slot):
    marker = tmp_path / "ran"
    ckpt = checkpoint_path(run, 2)
    if slot == "dcp/.metadata":  # DCP's own (pickled) metadata in place of harts' JSON
        (ckpt / "dcp" / METADATA_FILE).unlink()
        (ckpt / "dcp" / ".metadata").write_bytes(_payload(marker))
    elif slot == "meta.pt":  # a checkpoint of the older, pickled layout
        (ckpt / "meta.json").unlink()
        (ckpt / "meta.pt").write_bytes(_payload(marker))
    elif slot == "distcp-torch-file":
        _distcp_slot(ckpt, _torch_payload(marker, tmp_path / "plant.pt"))
    elif slot == "distcp-pickle":
        _distcp_slot(ckpt, _payload(marker))
    else:
        (ckpt / slot).write_bytes(_payload(marker))
    with pytest.raises(UserError) as err:
        load(ckpt)
    assert not marker.exists()
    assert "\n" not in str(err.value)
    # the run directory's other checkpoint still loads, and the plant still ran nothing
    net, got = load(run, fallback=True)
    assert not marker.exists()
    if slot == "meta.pt":
        assert got.step == 1 and not got.skipped  # no meta.json: step 2 is not complete
    else:
        assert got.step == 1 and got.skipped and "step-00000002 skipped" in got.skipped[0]


@pytest.mark.parametrize("slot", ["state.json", "model.safetensors", "optimizer.safetensors", "rng.safetensors"])
def test_a_planted_pickle_in_a_trainer_state_runs_nothing(tmp_path, slot):
    from harts.trainer.state import read_state, write_state

    net, opt = make(3)
    write_state(tmp_path / "state", net, opt, {"step": 3})
    marker = tmp_path / "ran"
    (tmp_path / "state" / slot).write_bytes(_payload(marker))
    with pytest.raises(UserError, match=slot):
        read_state(tmp_path / "state")
    assert not marker.exists()


# --------------------------------------------------------------------- damaged files
def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _garble(file: Path) -> None:
    data = file.read_bytes()
    rnd = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (len(data),), generator=rnd, dtype=torch.uint8).tolist()
    file.write_bytes(bytes(noise))


@pytest.mark.parametrize("how", [_truncate, _garble], ids=["truncated", "garbled"])
@pytest.mark.parametrize("slot", [*SLOTS, "rng"])
def test_damage_names_the_file_and_the_previous_checkpoint(run, slot, how):
    ckpt = checkpoint_path(run, 2)
    file = ckpt / ("rng/rank0.safetensors" if slot == "rng" else slot)
    if slot == "rng":  # missing rather than damaged: a rank's state is optional, so this loads
        file.unlink()
        assert load(run)[1].step == 2
        return
    how(file)
    with pytest.raises(DamagedCheckpoint) as err:
        load(run)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(file)), msg
    assert f"checkpoint step-00000002 is damaged; the previous one is {checkpoint_path(run, 1)}" in msg
    net, got = load(run, fallback=True)
    assert got.step == 1 and all(torch.equal(t, torch.ones_like(t)) for t in net.parameters())
    assert str(file) in got.skipped[0]


def test_the_only_checkpoint_damaged_says_there_is_no_earlier_one(tmp_path):
    ckpt = save(tmp_path / "run", 4)
    _truncate(ckpt / "dcp" / "__0_0.distcp")
    with pytest.raises(DamagedCheckpoint, match="truncated.*no earlier one is complete"):
        load(tmp_path / "run", fallback=True)


def test_no_checkpoint_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no complete checkpoint"):
        load(tmp_path)
    assert latest_checkpoint(tmp_path) is None


def _two_ranks_load(run: str) -> dict:
    """On every rank: the error of a plain load and the step a fallback load reaches."""
    import torch.distributed as dist

    try:
        load(Path(run))
        plain = None
    except DamagedCheckpoint as err:
        plain = str(err)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, plain)
    return {"errors": errors, "fallback": load(Path(run), fallback=True)[1].step}


def _two_ranks_save(run: str) -> None:
    for step in (1, 2):
        save(Path(run), step)


def test_one_rank_s_damaged_file_stops_every_rank_together(tmp_path):
    from tests.parallel._dist import spawn

    run = tmp_path / "run"
    spawn(2, _two_ranks_save, str(run), tmp=str(tmp_path))
    rng1 = checkpoint_path(run, 2) / "rng" / "rank1.safetensors"
    assert rng1.is_file()
    _garble(rng1)
    got = spawn(2, _two_ranks_load, str(run), tmp=str(tmp_path))
    assert got["errors"][0] == got["errors"][1] and got["errors"][0].startswith(f"{rng1}: ")
    assert got["fallback"] == 1


def _one_rank_cannot_write(run: str) -> dict:
    """Checkpoint 1 on both ranks, then checkpoint 2 with rank 1's files capped below its RNG
    state's size (a full disk on its side alone); every rank's error."""
    import resource

    import torch.distributed as dist

    from harts.errors import OutputPathError

    save(Path(run), 1)
    cap = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (512, cap[1]))
    try:
        save(Path(run), 2)
        got = None
    except OutputPathError as err:
        got = str(err)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, cap)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, got)
    return {"errors": errors}


def test_one_rank_s_failed_write_fails_every_rank_s_save(tmp_path):
    """Rank 1 cannot write its part of a checkpoint: every rank raises the same one line (none
    waits at the barrier for it), what was written of that checkpoint is removed, and the previous
    one is the newest."""
    from tests.parallel._dist import spawn

    run = tmp_path / "run"
    got = spawn(2, _one_rank_cannot_write, str(run), tmp=str(tmp_path))
    first, second = checkpoint_path(run, 1), checkpoint_path(run, 2)
    assert (
        got["errors"][0]
        == got["errors"][1]
        == (f"checkpoint {second}: cannot write: File too large (errno 27); the previous checkpoint {first} is whole")
    )
    assert latest_checkpoint(run) == first
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [first.name]

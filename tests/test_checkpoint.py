"""``checkpoint.pt`` (``labkit/app/checkpoint.py``): its header, checksum and contents are
checked before a resume uses them; a damaged, edited or hostile file is refused in one line
naming what is wrong, exit 2, and left as it was."""
from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from labkit.app import checkpoint
from labkit.app.cli import main
from tests import runs
from tests.runs import TINY, rewrite_checkpoint, run_cli, snapshot

# The fixtures tests/runs.py shares, found by pytest under these names.
copy_of, finished_run = runs.copy_of, runs.finished_run


# ---------------------------------------------------------------- 9. and 10. checkpoints


@pytest.mark.parametrize("edit, needle", [
    (lambda p: p.pop("device"), "field 'device' is missing"),
    (lambda p: p["state"].pop("optimizer"), "field 'state.optimizer' is missing"),
    (lambda p: p.update(device="tpu:0"), "field 'device' is not a device"),
    (lambda p: p["config"]["run"].update(value_head="popart"), "does not fit its config"),
    (lambda p: p["config"]["run"]["spec"].update(view=9), "does not fit its config"),
    (lambda p: p["config"]["run"].update(n_envs="four"), "config is not valid"),
    (lambda p: p["state"].update(iteration=99, global_step=99 * 64), "state.iteration"),
    (lambda p: p["state"].update(iteration=-1), "state.iteration"),
    (lambda p: p["state"]["agent"]["actor.weight"].fill_(math.nan),
     "'state.agent.actor.weight' holds non-finite"),
])
def test_checkpoint_contents_are_validated(copy_of, capsys, edit, needle):
    run = copy_of()
    rewrite_checkpoint(run / "checkpoint.pt",
                       lambda p: (p["config"].update(total_steps=256), edit(p)))
    # config.json agrees with the edited config: what is tested is the state against it.
    edited = checkpoint.load(run / "checkpoint.pt")["config"]
    (run / "config.json").write_text(json.dumps(edited))
    before = snapshot(run)
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert str(run / "checkpoint.pt") in err or "config" in err
    assert needle in err
    assert snapshot(run) == before


def test_a_flipped_byte_is_caught_by_the_checksum(copy_of, capsys):
    run = copy_of()
    data = bytearray((run / "checkpoint.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (run / "checkpoint.pt").write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.load(run / "checkpoint.pt")
    code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
    assert code == 2 and "corrupt" in err


# ---------------------------------------------------------------- a hostile checkpoint


class _Payload:
    """A pickle that, if ever unpickled, creates the file named in ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _hostile_bodies(marker: str) -> dict[str, bytes]:
    import pickle
    zipped, legacy = io.BytesIO(), io.BytesIO()
    torch.save({"format": 3, "x": _Payload(marker)}, zipped)
    torch.save({"format": 3, "x": _Payload(marker)}, legacy,
               _use_new_zipfile_serialization=False)
    return {"zip": zipped.getvalue(), "legacy": legacy.getvalue(),
            "raw": pickle.dumps({"format": 3, "x": _Payload(marker)})}


@pytest.mark.parametrize("kind", ["zip", "legacy", "raw"])
def test_a_hostile_checkpoint_with_a_valid_header_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                          capsys, kind):
    """A pickle behind labkit's own header and a correct checksum never runs its payload, and
    a body that is not torch.save's zip archive is refused before torch reads (and warns
    about) it: one line, exit 2."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--out", "run"]) == 0
    marker = tmp_path / "payload-ran"
    body = _hostile_bodies(str(marker))[kind]
    Path("run/checkpoint.pt").write_bytes(checkpoint.MAGIC + hashlib.sha256(body).digest() + body)
    code, _, err = run_cli(["train", "--resume", "run", "--no-progress"], capsys)
    assert code == 2 and "run/checkpoint.pt" in err and err.count("\n") == 1, err
    assert not marker.exists()
    if kind != "zip":
        assert "not the zip archive torch.save writes" in err, err


def _edits() -> list[tuple[str, object]]:
    """Hostile but well-formed edits of a checkpoint's state (the header and checksum are
    rewritten valid), each with what the refusal must name."""
    def env(key, fn):
        return lambda p: p["state"]["collector"]["env"].__setitem__(
            key, fn(p["state"]["collector"]["env"][key]))
    return [
        ("state['episode_return']", env("episode_return", lambda v: torch.full_like(v, math.nan))),
        ("state['episode']", env("episode", lambda v: torch.full_like(v, -1))),
        ("state['seed']", env("seed", lambda v: torch.full_like(v, -1))),
        ("state['pos']", env("pos", lambda v: torch.zeros_like(v))),
        ("state['grid']", env("grid", lambda v: torch.full_like(v, 99))),
        ("collector state['t']", lambda p: p["state"]["collector"].__setitem__(
            "t", torch.full_like(p["state"]["collector"]["t"], 999))),
        ("collector state['done']", lambda p: p["state"]["collector"].__setitem__(
            "done", torch.full_like(p["state"]["collector"]["done"], math.nan))),
        ("metrics state['returns']", lambda p: p["state"]["metrics"].__setitem__(
            "returns", [math.nan])),
        ("metrics state['lengths']", lambda p: p["state"]["metrics"].update(
            returns=[1.0], lengths=[0])),
        ("metrics state['returns'] must be reachable", lambda p: p["state"]["metrics"].update(
            returns=[1e9], lengths=[3])),  # a 3-step episode cannot return 1e9
        ("field 'wall_s'", lambda p: p.__setitem__("wall_s", -1e9)),
        ("field 'threads'", lambda p: p.__setitem__("threads", 0)),
        ("field 'threads'", lambda p: p.__setitem__("threads", 10**12)),
        ("['exp_avg_sq'] holds negative", lambda p: _adam(p, "exp_avg_sq", -1.0)),
        ("['step'] must be a whole number", lambda p: _adam(p, "step", -3.0)),
        ("different step counts", lambda p: p["state"]["optimizer"]["state"][0].__setitem__(
            "step", torch.tensor(99.0))),
    ]


def _adam(payload: dict, key: str, value: float) -> None:
    """Fill every parameter's Adam ``key`` with ``value`` (finite, so only the bounds can
    catch it)."""
    for entry in payload["state"]["optimizer"]["state"].values():
        entry[key] = torch.full_like(entry[key], value)


@pytest.mark.slow
def test_hostile_but_well_formed_saved_state_is_refused_at_the_door(tmp_path, monkeypatch,
                                                                    capsys):
    """Each edit behind a valid header and checksum: `train --resume` refuses it in one line
    naming the key, exit 2, and the checkpoint is left as it was."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", *TINY, "--stop-after", "1", "--out", "base"]) == 0
    for i, (needle, edit) in enumerate(_edits()):
        run = Path(f"run{i}")
        shutil.copytree("base", run)
        rewrite_checkpoint(run / "checkpoint.pt", edit)
        before = (run / "checkpoint.pt").read_bytes()
        code, _, err = run_cli(["train", "--resume", str(run), "--no-progress"], capsys)
        assert code == 2 and needle in err and err.count("\n") == 1, (needle, err)
        assert (run / "checkpoint.pt").read_bytes() == before

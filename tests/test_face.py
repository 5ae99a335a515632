"""``import labkit`` offers the names a reader types, lazily."""
import io
import math
import subprocess
import sys

import pytest
import torch

import labkit
from labkit.app.train import train
from labkit.config import BenchConfig, RunConfig
from labkit.logging import AsyncLogger
from labkit.ppo import PPOConfig
from labkit.stages import Pipeline, get_stage
from tests.runs import tiny_config


@pytest.mark.slow
def test_import_labkit_is_light_and_the_names_come_when_used():
    code = ("import sys, labkit; print('torch' in sys.modules); labkit.RunConfig; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "True"]


def test_the_face_names_what_the_modules_define():
    from labkit.app.train import train
    from labkit.config import RunConfig
    from labkit.doctor import diagnose
    from labkit.doctor.rehearsal import rehearse
    from labkit.measure.syncmeter import SyncMeter
    from labkit.stages import STAGES, Pipeline, get_stage

    assert (labkit.Pipeline, labkit.STAGES, labkit.get_stage, labkit.RunConfig, labkit.train,
            labkit.diagnose, labkit.rehearse, labkit.SyncMeter) == (
        Pipeline, STAGES, get_stage, RunConfig, train, diagnose, rehearse, SyncMeter)
    assert {"Pipeline", "train", "rehearse"} <= set(dir(labkit)) <= {*dir(labkit), *labkit.__all__}
    with pytest.raises(AttributeError, match="has no attribute 'Pipline'"):
        labkit.Pipline  # noqa: B018


@pytest.mark.slow
def test_the_readme_quick_start_runs():
    with labkit.Pipeline("fused_amp", labkit.RunConfig(n_envs=8, n_steps=16)) as pipe:
        stats = pipe.iteration()
    assert stats["episodes"] >= 0 and "pg_loss" in stats


# ---------------------------------------------------------------- 13. API edges


def test_api_edges_give_clear_errors(tiny_run):
    with Pipeline(get_stage(7), tiny_run, "cpu") as p:
        assert p.device.type == "cpu"
    with Pipeline(3, tiny_run, "cpu") as p:
        assert p.stage.name == "batched_ops"
    with pytest.raises(ValueError, match="stage must be one of"):
        get_stage(True)
    with pytest.raises(TypeError, match="stage_timeout_s"):
        BenchConfig(stage_timeout_s="10")
    with pytest.raises(ValueError, match="stage_timeout_s"):
        BenchConfig(stage_timeout_s=math.nan)
    with pytest.raises(TypeError, match="max_queue"):
        AsyncLogger(io.StringIO(), max_queue="5")
    for value in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="lr"):
            PPOConfig(lr=value)
    with pytest.raises(ValueError, match="needs about .* GiB on cpu"):
        Pipeline(3, RunConfig(n_envs=2**24, n_steps=32), "cpu")


def test_python_api_names_the_argument(tmp_path):
    """Bad input to the public API is a TypeError naming the argument, raised at the call
    (not in a writer thread or deep in pathlib): issue 23, G9."""
    import gymnasium as gym

    from labkit.logging import AsyncLogger, SyncLogger

    for bad in (5, {"height": 9}, "x"):
        with pytest.raises(TypeError, match="forage must be a ForageSpec"):
            gym.make("labkit.envs.gym:labkit/Forage-v0", forage=bad)  # the module registers
        with pytest.raises(TypeError, match="forage must be a ForageSpec"):
            gym.make_vec("labkit/Forage-v0", num_envs=2, forage=bad)
    with pytest.raises(TypeError, match="out must be a folder path"):
        train(tiny_config(), None, progress=False)
    for cls in (AsyncLogger, SyncLogger):
        with cls(tmp_path / f"{cls.__name__}.jsonl") as log:
            with pytest.raises(TypeError, match="x: expected a real number or tensor"):
                log.log(1, x=torch.tensor(1 + 2j))
            with pytest.raises(TypeError, match="step must be an int, got Tensor"):
                log.log(torch.tensor(1), x=1.0)
            log.log(2, x=1.0)  # still usable: nothing reached the writer

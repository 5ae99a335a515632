"""``import labkit`` offers the names a reader types, lazily."""
import subprocess
import sys

import pytest

import labkit


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


def test_the_readme_quick_start_runs():
    with labkit.Pipeline("fused_amp", labkit.RunConfig(n_envs=8, n_steps=16)) as pipe:
        stats = pipe.iteration()
    assert stats["episodes"] >= 0 and "pg_loss" in stats

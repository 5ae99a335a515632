"""The Python API and the notebook helpers given what they cannot use: one clear error naming
the argument or the field, never an internal AttributeError or NotImplementedError (issue 57,
class 7: the review's A-, B- and E- cases, tried the same way)."""
import json
import re

import pytest
import torch

import labkit
from labkit.book import plots, show
from labkit.config import RunConfig
from labkit.envs import ForageNumpy, ForageTorch
from labkit.stages import Pipeline

RUN = RunConfig(n_envs=4, n_steps=8)


@pytest.mark.slow
def test_a_closed_pipeline_says_so():
    with Pipeline("async_logging", RUN, torch.device("cpu")) as p:
        p.iteration()
    for call in (p.iteration, p.rollout):
        with pytest.raises(ValueError, match="this Pipeline is closed"):
            call()


def test_a_pipeline_loads_only_a_pipeline_state():
    with Pipeline("async_logging", RUN, torch.device("cpu")) as p:
        with pytest.raises(TypeError, match="state must be a PipelineState .* got dict"):
            p.load_state_dict({"agent": {}})
        p.load_state_dict(p.state_dict())


def test_train_takes_a_train_config(tmp_path):
    with pytest.raises(TypeError, match=r"cfg must be a TrainConfig .* got dict"):
        labkit.train({"n_envs": 8}, tmp_path / "a")
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("make", [ForageNumpy, ForageTorch])
@pytest.mark.parametrize("key", ["pos", "grid", "episode_return"])
def test_env_state_on_the_meta_device_is_refused_naming_the_key(make, key):
    env = make(4)
    state = env.state_dict()
    state[key] = torch.as_tensor(state[key]).to("meta")
    with pytest.raises(ValueError, match=rf"state\['{key}'\] is on the meta device"):
        env.load_state_dict(state)


def test_reads_table_names_what_it_takes():
    with pytest.raises(ValueError, match="reads_table: sites must be a dict .* got list"):
        show.reads_table([1, 2])


def test_recorded_gpu_names_a_file_whose_rows_are_not_rows(tmp_path):
    (tmp_path / "ladder_cuda_full.json").write_text(json.dumps(
        {"meta": {"device": "cuda"}, "ladder": [1, 2]}))
    with pytest.raises(ValueError, match=r"ladder_cuda_full.json: ladder row 0 is not a ladder "
                                         "row"):
        show.recorded_gpu(["x"], results=tmp_path)


@pytest.mark.parametrize("record, said", [
    ({"step": 64, "wall_s": 1.0, "mean_return": float("inf")}, "mean_return = inf"),
    ({"step": 64, "wall_s": 1e308, "mean_return": 1.0}, "wall_s = 1e+308"),
    ({"step": -64, "wall_s": 1.0, "mean_return": 1.0}, "step = -64"),
    ({"step": 64, "wall_s": 1.0, "mean_return": -1e300}, "mean_return = -1e+300"),
])
def test_run_curve_refuses_numbers_no_run_logs(tmp_path, record, said):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"metrics.jsonl line 1 has {said}, outside")):
        plots.run_curve(tmp_path)

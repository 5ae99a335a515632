"""``python -m labkit bench-sb3``: labkit's stage against Stable-Baselines3's PPO on the same
envs, network and hyperparameters (the sb3 extra; under CI=true its absence fails)."""
import json
import os

import numpy as np
import pytest
import torch

from labkit.app.cli import main
from labkit.config import RunConfig
from labkit.envs import ForageNumpy, ForageSpec, ForageTorch
from labkit.stages import REFERENCE_STAGE, get_stage


def _needs_sb3():
    if os.environ.get("CI") == "true":
        import stable_baselines3  # noqa: F401
    else:
        pytest.importorskip("stable_baselines3")


@pytest.mark.parametrize("env_class", [ForageNumpy, ForageTorch])
def test_sb3_steps_the_same_envs_and_sees_each_ended_episode(env_class):
    _needs_sb3()
    from labkit.measure.sb3bench import _vec_env

    cfg = RunConfig(n_envs=4, n_steps=8, spec=ForageSpec(episode_length=5))
    env, ref = _vec_env(4, cfg, env_class), ForageNumpy(4, cfg.spec, cfg.seed, final_obs=True)
    assert np.array_equal(env.reset(), ref.reset()[0])
    rng = np.random.default_rng(0)
    for t in range(1, 11):
        actions = rng.integers(0, 5, 4)
        env.step_async(actions)
        obs, reward, done, infos = env.step_wait()
        obs_r, reward_r, _, truncated, info = ref.step(actions)
        assert np.array_equal(obs, obs_r) and np.array_equal(reward, reward_r)
        assert done.tolist() == truncated.tolist() == [t % 5 == 0] * 4
        for i in np.flatnonzero(done):
            assert np.array_equal(infos[i]["terminal_observation"],
                                  info["final_observation"][i])
            assert infos[i]["TimeLimit.truncated"] and infos[i]["episode"]["l"] == 5


def test_sb3_runs_labkits_network():
    _needs_sb3()
    from labkit.measure.sb3bench import _sb3_model, _vec_env
    from labkit.policy import Agent

    cfg = RunConfig(n_envs=4, n_steps=8)
    model = _sb3_model(cfg, _vec_env(4, cfg))
    ours = sorted(tuple(p.shape) for p in Agent().parameters())
    theirs = sorted(tuple(p.shape) for p in model.policy.parameters())
    assert ours == theirs, (ours, theirs)
    assert model.batch_size == 4 * 8 // cfg.ppo.n_minibatches
    assert model.n_epochs == cfg.ppo.update_epochs


@pytest.mark.slow
def test_the_comparison_is_timed_interleaved_and_written(tmp_path, capsys):
    _needs_sb3()
    assert main(["bench-sb3", "--n-envs", "8", "--n-steps", "16", "--iterations", "1",
                 "--rounds", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_sb3_cpu.json").read_text())
    sb3, labkit = result["rows"]
    assert (sb3["who"], labkit["who"]) == ("sb3", "labkit") and result["threads"] == 1
    assert len(sb3["seconds"]) == len(labkit["seconds"]) == 2
    assert labkit["x_sb3"] == pytest.approx(labkit["sps"] / sb3["sps"])
    assert torch.get_num_threads() != 1 or os.cpu_count() == 1  # restored after
    out = capsys.readouterr().out
    env = get_stage(REFERENCE_STAGE).env.__name__  # the default stage's own envs
    assert result["stage"] == REFERENCE_STAGE and result["env"] == env
    assert f"same work: {env} x 8 envs" in out

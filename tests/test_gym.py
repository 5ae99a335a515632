"""Forage in Gymnasium: the env checker passes silently, make/make_vec work, and the vector env
is ForageNumpy (or ForageTorch) bit for bit, same-step autoreset included."""
from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

gym = pytest.importorskip("gymnasium")

from labkit.envs import ForageNumpy, ForagePy, ForageTorch  # noqa: E402
from labkit.envs.gym import ENV_ID, ForageEnv, ForageVectorEnv  # noqa: E402


def test_the_env_checker_passes_without_warnings():
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(ForageEnv(), skip_render_check=True)
        env = gym.make(ENV_ID)  # with Gymnasium's passive checker and order enforcing
        env.reset(seed=0)
        for _ in range(200):
            env.step(env.action_space.sample())
    assert [str(w.message) for w in caught] == []


def test_single_env_episodes_follow_the_reference_stream(short_spec):
    """Episode after episode (reset() after each truncation) equals ForagePy's same-step
    stream; the truncating step returns the episode's own last observation."""
    env, ref = ForageEnv(short_spec), ForagePy(short_spec, seed=4, final_obs=True)
    obs, _ = env.reset(seed=4)
    ref_obs = ref.reset()[0]
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(3 * short_spec.episode_length):
        a = int(rng.integers(5))
        obs, reward, term, trunc, info = env.step(a)
        ref_obs, ref_reward, _, ref_trunc, ref_info = ref.step(a)
        assert reward == ref_reward and trunc == ref_trunc and not term
        if trunc:
            ended += 1
            assert np.array_equal(obs, np.asarray(ref_info["final_observation"], np.float32))
            assert info["episode_return"] == ref_info["episode_return"]
            obs, _ = env.reset()
        assert np.array_equal(obs, np.asarray(ref_obs, np.float32))
    assert ended == 3
    with pytest.raises(ValueError, match="action must be"):
        env.step(7)
    with pytest.raises(ValueError, match="seed must be"):
        env.reset(seed=-1)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_vector_env_is_the_vectorized_forage_bit_for_bit(backend, short_spec):
    envs = gym.make_vec(ENV_ID, num_envs=8, forage=short_spec, backend=backend)
    assert isinstance(envs, ForageVectorEnv)
    assert envs.metadata["autoreset_mode"] == gym.vector.AutoresetMode.SAME_STEP
    if backend == "numpy":
        ref = ForageNumpy(8, short_spec, 3, final_obs=True)
        as_array = np.asarray
    else:
        ref = ForageTorch(8, short_spec, 3, final_obs=True)
        as_array = torch.as_tensor
    obs, _ = envs.reset(seed=3)
    ref_obs, _ = ref.reset()
    equal = np.array_equal if backend == "numpy" else torch.equal
    assert equal(obs, ref_obs)
    rng = np.random.default_rng(1)
    finals = 0
    for _ in range(50):
        a = rng.integers(0, 5, 8)
        obs, reward, term, trunc, info = envs.step(as_array(a))
        ref_obs, ref_reward, _, ref_trunc, ref_info = ref.step(as_array(a))
        assert equal(obs, ref_obs) and equal(reward, ref_reward) and equal(trunc, ref_trunc)
        assert equal(info["final_obs"], ref_info["final_observation"])
        finals += int(info["_final_obs"].sum())
    assert finals == 16  # two 20-step episodes ended in every env within 50 steps
    with pytest.raises(ValueError, match="backend must be"):
        ForageVectorEnv(2, backend="jax")


def test_vector_info_has_the_layout_of_gymnasiums_own_vector_env(short_spec):
    """final_obs / final_info and their masks, as SyncVectorEnv(same-step) gives them."""
    n = 4
    ours = ForageVectorEnv(n, short_spec)
    theirs = gym.vector.SyncVectorEnv([lambda: ForageEnv(short_spec)] * n,
                                      autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    infos = []
    for envs in (ours, theirs):
        envs.reset(seed=0)
        for _ in range(short_spec.episode_length):
            *_, trunc, info = envs.step(np.zeros(n, dtype=np.int64))
        assert trunc.all()
        infos.append(info)
    mine, ref = infos
    assert set(ref) <= set(mine) and set(ref["final_info"]) == set(mine["final_info"])
    for key in ("_final_obs", "_final_info"):
        assert np.array_equal(mine[key], ref[key])
    final = mine["final_info"]
    assert np.array_equal(final["episode_length"], ref["final_info"]["episode_length"])
    assert final["_episode_return"].all() and final["episode_length"].tolist() == [20] * n
    assert np.stack(list(ref["final_obs"])).shape == mine["final_obs"].shape


@pytest.mark.slow
def test_a_cleanrl_style_loop_trains_on_it():
    path = Path(__file__).parents[1] / "examples" / "cleanrl_gymnasium.py"
    spec = importlib.util.spec_from_file_location("cleanrl_gymnasium", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["cleanrl_gymnasium"] = module
    spec.loader.exec_module(module)
    out = module.main(module.Args(total_timesteps=4096, num_envs=16, num_steps=32,
                                  cuda=False))
    assert out["iterations"] == 8 and np.isfinite(out["loss"])
    assert len(out["episode_returns"]) == 16 * 2  # 256 steps per env: two 128-step episodes


@pytest.mark.slow
def test_importing_labkit_envs_imports_no_gymnasium_and_the_gym_module_registers():
    """Registration is the Gymnasium module's own doing: ``import labkit.envs`` (every run)
    neither imports Gymnasium nor registers; ``gym.make("labkit.envs.gym:labkit/Forage-v0")``
    imports the module that registers, as Gymnasium's "module:id" form is meant for."""
    import subprocess

    code = ("import sys, labkit.envs; print('gymnasium' in sys.modules); "
            "import gymnasium as gym; print('labkit/Forage-v0' in gym.registry); "
            "env = gym.make('labkit.envs.gym:labkit/Forage-v0'); "
            "print('labkit/Forage-v0' in gym.registry, type(env.unwrapped).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1]).stdout.split()
    assert out == ["False", "False", "True", "ForageEnv"]


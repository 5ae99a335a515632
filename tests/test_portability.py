"""The tree runs where it is copied without being installed (a GPU machine gets the working
tree and a few wheels), and prints nothing on CUDA that the CPU does not: what a recorded
notebook compares must not depend on the device."""
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.slow
def test_pytest_imports_this_checkout_where_labkit_is_not_installed(tmp_path):
    """pyproject's ``pythonpath``: the bare ``pytest`` command (not ``python -m pytest``, which
    adds the working directory itself) imports labkit from the tree it runs in."""
    runner = shutil.which("pytest", path=str(Path(sys.executable).parent)) or \
        shutil.which("pytest")
    if runner is None:
        pytest.skip("no pytest command on PATH")
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "labkit", tree / "labkit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    (tree / "tests").mkdir()
    (tree / "tests" / "test_where.py").write_text(
        "from pathlib import Path\n\nimport labkit\n\n\ndef test_where():\n"
        "    assert Path(labkit.__file__).parents[1] == Path(__file__).parents[1]\n")
    done = subprocess.run([runner, "-q", "-p", "no:cacheprovider", "tests/test_where.py"],
                          cwd=tree, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_tf32_advice_is_answered_by_labkit():
    """Inductor advises TF32 on GPUs that have it, on stderr, at the first fp32 compile: a
    line that a GPU-recorded notebook would show and the CPU would not. labkit's fp32 is full
    fp32 on purpose (labkit.executors says why), so that one message is silenced, and only
    that one, by every compiled executor."""
    from labkit.executors import Compiled

    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # as if a catch_warnings block had dropped labkit's filter
        Compiled().wrap_model(lambda x: x)  # compiles nothing until called
        warnings.warn("TensorFloat32 tensor cores for float32 matrix multiplication available "
                      "but not enabled. Consider setting ...", UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning"]


def test_ladder_controls_without_ipywidgets_say_so_in_one_line(monkeypatch, capsys):
    from labkit.book import widgets

    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails as if not installed
    assert widgets.ladder_controls() is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "pip install ipywidgets" in out


def test_the_gpu_session_script_refuses_what_it_cannot_run(tmp_path):
    script = ROOT / "scripts" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}
    no_commit = subprocess.run(["bash", str(script), "--tests"], env=env, capture_output=True,
                               text=True)
    assert no_commit.returncode != 0 and "LABKIT_GIT_COMMIT" in no_commit.stderr
    bad = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True,
                         env={**env, "LABKIT_GIT_COMMIT": "abc1234"})
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


def test_deterministic_sets_cudnn_and_puts_it_back():
    import torch

    from labkit.device import deterministic

    cudnn = torch.backends.cudnn
    before = cudnn.deterministic, cudnn.benchmark
    with deterministic():
        assert (cudnn.deterministic, cudnn.benchmark) == (True, False)
    assert (cudnn.deterministic, cudnn.benchmark) == before


def test_only_the_graphed_stage_builds_a_capturable_optimizer():
    """torch warns on stderr when a capturable optimizer steps outside a CUDA graph capture:
    stage 7 (eager steps) must not be capturable, stage 8 (captured steps) must."""
    from labkit.stages import STAGES

    assert [getattr(s.optimizer, "capturable", False) for s in STAGES] == [False] * 8 + [True]


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_stage_7_on_cuda_steps_without_torchs_capturable_warning():
    import torch

    from labkit.config import RunConfig
    from labkit.stages import STAGES, Pipeline

    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=".*capturable=True")
        with Pipeline(STAGES[7], RunConfig(n_envs=8, n_steps=16), "cuda") as p:
            p.iteration()
            torch.cuda.synchronize()
    assert not [w for w in caught if "capturable" in str(w.message)]

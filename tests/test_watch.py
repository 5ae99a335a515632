"""``labkit.watch`` and ``python -m labkit watch``: the doctor's meters on training code nobody
here wrote (CleanRL's PPO verbatim, Stable-Baselines3's PPO), judged by the source text at the
lines the report names, never by line numbers."""
from __future__ import annotations

import json
import linecache
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from labkit.app.cli import main
from labkit.doctor.watch import watch
from labkit.measure import syncmeter
from labkit.measure.kernels import generated_launches

ROOT = Path(__file__).resolve().parents[1]
CLEANRL = ROOT / "tests" / "thirdparty" / "cleanrl_ppo.py"


def _needs(module: str):
    """Skip without ``module``, except under CI=true, where it is installed (pyproject's sb3
    and cleanrl extras) and its absence is a failure."""
    if os.environ.get("CI") == "true":
        __import__(module)
        return
    pytest.importorskip(module)


def _source(where: str) -> str:
    """The source text at a finding's ``file:line`` (a path inside the repo or a package)."""
    path, line = where.split(" ")[0].rsplit(":", 1)
    for base in (ROOT, *map(Path, sys.path)):
        if (base / path).is_file():
            return linecache.getline(str(base / path), int(line)).strip()
    raise AssertionError(f"no file for {where}")


def _cli_json(argv: list[str], cwd: Path) -> tuple[dict, subprocess.CompletedProcess]:
    done = subprocess.run([sys.executable, "-m", "labkit", "watch", "--json", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    start = done.stdout.rindex("\n{\n") + 1 if "\n{\n" in done.stdout else 0
    return json.loads(done.stdout[start:]), done


# ---------------------------------------------------------------- the Python API


def _loop(w, iterations=3, keep=None):
    net = torch.nn.Linear(4, 2)
    for _ in range(iterations):
        x = torch.zeros(8, 4)  # a factory that names no device
        y = net(x)
        y.sum().item()  # a device read: y comes from the parameters
        if keep is not None:
            keep.append(y.detach())
        w.step()


@pytest.mark.slow
def test_counts_per_iteration_at_the_readers_lines():
    with watch() as w:
        _loop(w, iterations=3)
    r = w.report()
    assert r.iterations == 3 and r.device_reads == 3 and r.host_scalar_reads == 0
    by_kind = {(f.kind, _source(f.where)) for f in r.findings}
    assert by_kind == {("device_read", "y.sum().item()  # a device read: y comes from the "
                                       "parameters"),
                       ("no_device", "x = torch.zeros(8, 4)  # a factory that names no device")}
    assert all(f.evidence["per_iteration"] == 1 for f in r.findings)
    assert "fix: chapter 07" in r.format() and json.loads(r.to_json())["iterations"] == 3


@pytest.mark.slow
def test_without_the_data_flow_its_own_op_count_sees_the_same_findings():
    """``watch(device="cuda")`` skips the sync meter's data flow (a CPU tensor is then a host
    tensor), so the op count runs as a dispatch mode of its own: same ops and findings."""
    with watch(device="cuda") as w:
        _loop(w, iterations=2)
    r = w.report()
    assert r.device_reads == 0 and r.host_scalar_reads == 2  # CPU tensors in a "CUDA" run
    assert r.ops > 0 and {(f.kind, f.evidence["per_iteration"]) for f in r.findings} == {
        ("host_scalar_read", 1), ("no_device", 1)}


@pytest.mark.slow
def test_a_growing_container_is_named():
    history: list = []
    with watch() as w:
        _loop(w, iterations=5, keep=history)
    grown = [f for f in w.report().findings if f.kind == "memory_growth"]
    assert len(grown) == 1 and grown[0].evidence["per_iteration"] == 1
    assert grown[0].where == "a list held as history (a local of test_a_growing_container_is_named)"


def test_nothing_stays_patched_also_when_the_block_raises():
    from torch._inductor.output_code import CompiledFxGraph

    methods = {name: getattr(torch.Tensor, name) for name in (*syncmeter._READS, "to", "copy_")}
    graph_call = CompiledFxGraph.__call__
    with pytest.raises(ZeroDivisionError), watch() as w:
        assert CompiledFxGraph.__call__ is not graph_call  # counting compiled kernels
        torch.ones(2).sum().item()
        raise ZeroDivisionError
    assert {name: getattr(torch.Tensor, name) for name in methods} == methods
    assert CompiledFxGraph.__call__ is graph_call
    assert not watch._active and w.report().host_scalar_reads + w.report().device_reads == 1
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    assert not _get_current_function_mode_stack() and not _get_current_dispatch_mode_stack()


def test_one_dispatch_mode_sees_each_op_while_watching():
    """The overhead's design: every op passes through torch's Python dispatch once (the sync
    meter's data flow, which tells the op count), with no function mode: a second meter per
    op would double the cost that ``scripts/watch_overhead.py`` measures."""
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    with watch():
        modes = _get_current_dispatch_mode_stack()
        functions = _get_current_function_mode_stack()
    assert len(modes) == 1 and not functions, (modes, functions)


@pytest.mark.slow
def test_nested_watches_are_refused_clearly_and_a_decorator_counts_each_call():
    with watch(), pytest.raises(RuntimeError, match="do not nest"), watch():
        pass
    w = watch()

    @w
    def step(x):
        return x.sum().item()

    for _ in range(4):
        step(torch.ones(3))
    # made before the watch: taken for a device tensor (a false alarm, never a false "ok")
    assert w.iterations == 4 and w.report().device_reads == 4
    assert not watch._active


@pytest.mark.slow
def test_graph_breaks_and_recompiles_of_a_compiled_function():
    @torch.compile
    def f(x):
        return x * x.sum().item()  # a graph break: a host read in the compiled region

    with watch() as w:
        for n in (4, 5, 6):
            f(torch.ones(n))
            w.step()
    r = w.report()
    assert sum(r.graph_breaks.values()) >= 1 and r.new_graphs >= 2
    assert any(f.kind == "graph_break" for f in r.findings)


def _compile_then_watch(fn, arguments, recompile_limit=8):
    """Watch one call of compiled ``fn`` per iteration, one argument each."""
    with torch._dynamo.config.patch(recompile_limit=recompile_limit), watch() as w:
        for argument in arguments:
            fn(argument)
            w.step()
    return w.report()


@pytest.mark.inductor
@pytest.mark.slow
def test_a_function_that_keeps_recompiling_and_then_falls_back_to_eager():
    """A Python number changing each call fails a guard each time: new graphs after warm-up,
    until the recompile limit, after which dynamo runs it eagerly and says nothing more."""
    scale = torch.ones(4)

    @torch.compile(dynamic=False)
    def scaled(k):
        return scale * k + 1

    r = _compile_then_watch(scaled, [float(k) for k in range(8)], recompile_limit=4)
    kinds = {f.kind: f for f in r.findings}
    assert {"graph_growth", "recompile_limit"} <= set(kinds)
    # graphs 1-4 in iterations 1-4: two of them after the two warm-up iterations
    assert kinds["graph_growth"].evidence["total"] == 2 and "k == " in kinds["graph_growth"].summary
    assert kinds["recompile_limit"].where.endswith("(scaled)")
    assert _source(kinds["graph_growth"].where).startswith("@torch.compile")


@pytest.mark.slow
def test_a_function_that_stops_recompiling_is_no_growth():
    """A new shape in the second call makes one more graph (a dynamic one): no growth."""
    @torch.compile
    def doubled(x):
        return x * 2

    r = _compile_then_watch(doubled, [torch.ones(n) for n in (3, 4, 5, 6, 7)])
    assert not [f for f in r.findings if f.kind in ("graph_growth", "recompile_limit")]
    assert [f.kind for f in r.findings if f.kind == "recompile"] == ["recompile"]


@pytest.mark.inductor
@pytest.mark.slow
def test_the_kernels_a_compiled_region_generates_are_counted_as_the_profiler_sees_them():
    """Counted from the generated wrapper's source, checked against the profiler's events of
    the same kernels (inductor's cpp kernels record themselves when asked to)."""
    import torch._inductor.config as inductor_config
    from torch.profiler import profile

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 6 * 6, 5))
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        @torch.compile
        def loss(x):
            return torch.log_softmax(net(x), -1).square().mean()

        loss(torch.randn(4, 3, 8, 8)).backward()
        with profile() as prof, watch() as w:
            for _ in range(3):
                loss(torch.randn(4, 3, 8, 8)).backward()
                w.step()
    seen = Counter(re.sub(r"^graph_\d+_|_\d+$", "", e.name) for e in prof.events()
                   if re.match(r"graph_\d+_cpp_fused", e.name))
    counted = {k.removeprefix("inductor::"): n for k, n in w.ops.items()
               if k.startswith("inductor::")}
    assert seen and counted == dict(seen)
    r = w.report()
    assert r.ops == sum(w.ops.values()) and r.ops / 3 > sum(counted.values()) / 3 >= 4


def test_the_generated_kernels_of_a_gpu_wrapper_are_read_too():
    """A wrapper inductor writes for a GPU (its shape, by hand: no GPU here): triton kernels
    launched with ``.run``, their own ``def`` inside the source string not counted."""
    source = (
        "triton_poi_fused_relu_0 = async_compile.triton('triton_poi_fused_relu_0', '''\n"
        "def triton_poi_fused_relu_0(in_ptr0, out_ptr0, xnumel, XBLOCK):\n    pass\n''')\n"
        "triton_red_fused_sum_1 = async_compile.triton('triton_red_fused_sum_1', '''\n"
        "def triton_red_fused_sum_1(in_ptr0):\n    pass\n''')\n"
        "class Runner:\n    def call(self, args):\n"
        "        # triton_poi_fused_relu_0(buf0) in a comment\n"
        "        extern_kernels.mm(arg0_1, arg1_1, out=buf0)\n"
        "        triton_poi_fused_relu_0.run(buf0, buf1, 256, stream=stream0)\n"
        "        triton_red_fused_sum_1.run(buf1, stream=stream0)\n"
        "        triton_poi_fused_relu_0.run(buf2, buf3, 256, stream=stream0)\n")
    assert generated_launches(source) == ("triton_poi_fused_relu_0", "triton_red_fused_sum_1",
                                          "triton_poi_fused_relu_0")
    assert generated_launches("def call(args):\n    return args\n") == ()


@pytest.mark.inductor
@pytest.mark.cuda
def test_the_triton_kernels_of_a_compiled_region_are_counted_as_the_profiler_sees_them():
    """On a GPU: the kernels read from each compiled graph's real wrapper, counted per call,
    match the profiler's CUDA kernel events named ``triton_*`` (the extern matmuls are cuBLAS
    kernels under other names, left out on both sides)."""
    from torch.profiler import ProfilerActivity, profile

    from labkit.measure.kernels import compiled_kernels

    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 5)).cuda()

    @torch.compile
    def loss(x):
        return torch.log_softmax(net(x), -1).square().mean()

    loss(torch.randn(64, 16, device="cuda")).backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, \
            compiled_kernels() as k:
        for _ in range(3):
            loss(torch.randn(64, 16, device="cuda")).backward()
        torch.cuda.synchronize()
    seen = Counter(re.sub(r"_\d+$", "", e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.name.startswith("triton_"))
    print("counted", dict(k.counts), "profiler", dict(seen))
    assert k.graphs == 6 and seen and dict(k.counts) == dict(seen)


# ---------------------------------------------------------------- the command


def test_cli_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys):
    assert main(["watch", str(tmp_path / "missing.py")]) == 2
    assert capsys.readouterr().err.startswith("error: script ")
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert main(["watch", "--function", "not a name", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --function must be") and err.count("\n") == 1


@pytest.mark.parametrize("argv, said", [
    (["-m", "labkit_no_such_module_here"], "error: module 'labkit_no_such_module_here': no "
                                           "such module"),
    (["-m", "labkit_no_such_package.inner"], "error: module 'labkit_no_such_package.inner': "),
    (["FOLDER"], "is a folder, not a file"),
])
def test_cli_refuses_a_missing_module_or_a_folder_in_one_line(tmp_path, capsys, argv, said):
    """``watch -m`` of a module that cannot be found, or a folder given as the script: one
    line, exit 2, and no report of a script that never ran."""
    argv = [str(tmp_path) if a == "FOLDER" else a for a in argv]
    assert main(["watch", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and said in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert out == ""


def test_a_script_that_removes_the_profile_hook_is_named_not_called_never(tmp_path, capsys):
    """A script that clears the profiler (``sys.setprofile(None)``, or sets its own) takes
    ``--function``'s hook away: the report says so, not that the function was never called."""
    script = tmp_path / "s.py"
    script.write_text("import sys\nimport torch\n\ndef step():\n    torch.ones(2).sum()\n\n"
                      "step()\nsys.setprofile(None)\nfor _ in range(3):\n    step()\n")
    assert main(["watch", "--function", "step", str(script)]) == 0
    out = capsys.readouterr().out
    assert "replaced labkit's profile hook" in out and "never called" not in out, out
    assert "1 function(s) of that name seen before" in out


@pytest.mark.parametrize("body, code, said", [
    ("import sys\nsys.exit(3)\n", 3, None),
    ("raise KeyError('mine')\n", 1, "KeyError: 'mine'"),
    ("def loop():\n    pass\n", 0, "never called a function of that name"),
])
def test_cli_returns_the_scripts_code_after_the_report(tmp_path, capsys, body, code, said):
    script = tmp_path / "s.py"
    script.write_text("import torch\ntorch.ones(1).sum().item()\n" + body)
    assert main(["watch", "--function", "step", str(script)]) == code
    out, err = capsys.readouterr()
    assert out.startswith("labkit watch:"), out
    assert said is None or said in out + err, (out, err)


@pytest.mark.slow
def test_cli_runs_a_module_and_passes_its_arguments(tmp_path, capsys, monkeypatch):
    (tmp_path / "readers_loop.py").write_text(
        "import sys, torch\n"
        "def step(n):\n    return torch.arange(n).sum().item()\n"
        "for _ in range(int(sys.argv[1])):\n    step(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["watch", "--function", "step", "-m", "readers_loop", "5"]) == 0
    out = capsys.readouterr().out
    assert "5 iteration(s)" in out and "host-scalar" in out


# ---------------------------------------------------------------- code nobody here wrote

#: CleanRL's reads and the rest, by kind and the source text at the reported line.
CLEANRL_FINDINGS = {
    ("device_read", "probs = Categorical(logits=logits)"),  # argument validation
    ("device_read", "return action, probs.log_prob(action), probs.entropy(), self.critic(x)"),
    ("device_read", "next_obs, reward, terminations, truncations, infos = "
                    "envs.step(action.cpu().numpy())"),
    ("host_scalar_read", "next_obs, reward, terminations, truncations, infos = "
                         "envs.step(action.cpu().numpy())"),  # .numpy() of the host copy
    ("device_read", "clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean()"
                    ".item()]"),
    ("device_read", "y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()"),
    ("host_scalar_read", "y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()"),
    ("host_scalar_read", "optimizer.step()"),  # Adam's CPU step counters
    *(("device_read", f'writer.add_scalar("losses/{name}", {var}.item(), global_step)')
      for name, var in (("value_loss", "v_loss"), ("policy_loss", "pg_loss"),
                        ("entropy", "entropy_loss"), ("old_approx_kl", "old_approx_kl"),
                        ("approx_kl", "approx_kl"))),
    ("from_data", "rewards[step] = torch.tensor(reward).to(device).view(-1)"),
    ("from_data", "next_obs = torch.Tensor(next_obs).to(device)"),
    ("from_data", "next_obs, next_done = torch.Tensor(next_obs).to(device), "
                  "torch.Tensor(next_done).to(device)"),
    *(("no_device", f"{name} = torch.zeros({shape}).to(device)") for name, shape in (
        ("obs", "(args.num_steps, args.num_envs) + envs.single_observation_space.shape"),
        ("actions", "(args.num_steps, args.num_envs) + envs.single_action_space.shape"),
        ("logprobs", "(args.num_steps, args.num_envs)"),
        ("rewards", "(args.num_steps, args.num_envs)"),
        ("dones", "(args.num_steps, args.num_envs)"),
        ("values", "(args.num_steps, args.num_envs)"),
        ("next_done", "args.num_envs"))),
    # indexing with a NumPy array of minibatch indices: an index tensor made from it each time
    *(("from_data", text) for text in (
        "_, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], "
        "b_actions.long()[mb_inds])",
        "logratio = newlogprob - b_logprobs[mb_inds]",
        "mb_advantages = b_advantages[mb_inds]",
        "v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2",
        "v_clipped = b_values[mb_inds] + torch.clamp(",
        "newvalue - b_values[mb_inds],",
        "v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2")),
}


@pytest.mark.slow
def test_cleanrl_ppo_verbatim_every_known_read_and_nothing_else(tmp_path):
    _needs("tyro")
    _needs("gymnasium")
    report, done = _cli_json([str(CLEANRL), "--total-timesteps", "512", "--num-envs", "4",
                              "--num-steps", "64", "--no-cuda"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    found = {(f["kind"], _source(f["where"])) for f in report["findings"]}
    assert found == CLEANRL_FINDINGS, (found - CLEANRL_FINDINGS, CLEANRL_FINDINGS - found)
    totals = {(f["kind"], _source(f["where"])): f["evidence"]["total"] for f in report["findings"]}
    steps = 2 * 64  # 2 iterations of 64 steps
    assert totals[("device_read", "next_obs, reward, terminations, truncations, infos = "
                                  "envs.step(action.cpu().numpy())")] == steps
    assert totals[("device_read", "probs = Categorical(logits=logits)")] == steps + 2 * 4 * 4


@pytest.mark.slow
def test_sb3_ppo_from_the_shell_names_sb3s_own_reads_per_rollout(tmp_path):
    _needs("stable_baselines3")
    script = tmp_path / "sb3_cartpole.py"
    script.write_text(
        "from stable_baselines3 import PPO\n"
        "model = PPO('MlpPolicy', 'CartPole-v1', n_steps=64, batch_size=64, n_epochs=2, "
        "seed=0, device='cpu')\nmodel.learn(256)\n")
    runs = [_cli_json(["--function", "collect_rollouts", str(script)], tmp_path)
            for _ in range(2)]
    for report, done in runs:
        assert done.returncode == 0, done.stderr[-2000:]
        assert report["iterations"] == 4  # 256 steps in rollouts of 64
    first, second = ({(f["kind"], f["where"], f["evidence"]["total"]) for f in r["findings"]}
                     for r, _ in runs)
    assert first == second  # stable across runs
    per = {(f["kind"], _source(f["where"])): f["evidence"]["per_iteration"]
           for f in runs[0][0]["findings"]}
    sources = {text for _, text in per}
    # SB3's own per-step reads, at its lines: the actions to the env, the values and log
    # probabilities into the rollout buffer (cloned, then copied to NumPy)
    assert any(".cpu().numpy()" in text and kind == "device_read" and n == 64
               for (kind, text), n in per.items()), per
    assert any("clone().cpu().numpy()" in text for text in sources), sources
    assert any(f["kind"] == "device_read" and "distributions.py" in f["where"]
               for f in runs[0][0]["findings"])  # Categorical's argument validation
    assert all("stable_baselines3" in f["where"] for f in runs[0][0]["findings"]
               if f["kind"] != "graph_break")


@pytest.mark.slow
def test_sb3_ppo_watched_from_python_on_forage(tmp_path):
    _needs("stable_baselines3")
    _needs("gymnasium")
    import gymnasium as gym
    from stable_baselines3 import PPO

    import labkit.envs.gym  # noqa: F401 - registers labkit/Forage-v0

    env = gym.make("labkit/Forage-v0")
    model = PPO("MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=1, seed=0, device="cpu")
    w = watch()
    model.collect_rollouts = w(model.collect_rollouts)  # each rollout one iteration
    model.learn(128)
    r = w.report()
    assert r.iterations == 2 and r.device_reads >= 64 * 2
    assert all("stable_baselines3" in f.where for f in r.findings if f.kind == "device_read")


STEP = "import os, torch\n\n\ndef step(x):\n    return x.sum().item()\n\n\n"


@pytest.mark.slow
def test_a_script_that_ends_in_os_exit_gets_its_report_and_its_code(tmp_path):
    """os._exit runs no Python cleanup: the report is printed before the process ends, says
    so, and the exit code stays the script's."""
    script = tmp_path / "exits.py"
    script.write_text(STEP + "for _ in range(3):\n    step(torch.ones(3))\nos._exit(7)\n")
    report, done = _cli_json(["--function", "step", str(script)], tmp_path)
    assert done.returncode == 7, done.stderr[-2000:]
    assert report["iterations"] == 3 and report["device_reads"] == 3
    assert "ended with os._exit(7)" in report["notes"][0]


@pytest.mark.slow
def test_a_script_that_forks_gets_one_report_saying_so(tmp_path):
    """The forked child runs the same code under the same hook: it prints no report of its
    own (there was a second, full one), and the parent's says only it was watched."""
    script = tmp_path / "forks.py"
    script.write_text(STEP + "step(torch.ones(3))\npid = os.fork()\nstep(torch.ones(3))\n"
                             "if pid:\n    os.waitpid(pid, 0)\n")
    report, done = _cli_json(["--function", "step", str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count('"iterations"') == 1  # one report
    assert report["iterations"] == 2
    assert "the script forked 1 process(es): only this one is watched" in report["notes"]


def test_a_python_number_torch_wraps_is_no_host_factory_but_a_scalar_tensor_call_is():
    """``torch.where(m, x, 0.0)`` wraps 0.0 in a 0-d CPU tensor (aten::scalar_tensor): torch's
    doing, a CUDA kernel's argument on a GPU, not a factory of the code's. The same op called
    by name in the code is one."""
    done, x = torch.tensor([True, False], device="cpu"), torch.ones(2)
    with watch("cpu") as w:
        torch.where(done, x, 0.0).amin()
        torch.where(done, x, math.inf)
        torch.scalar_tensor(3.0)  # the code's own factory, no device named
    (site,) = w.calls["no_device"]
    assert w.calls["no_device"][site] == 1 and "scalar_tensor" in linecache.getline(
        __file__, int(site.split(" ")[0].rpartition(":")[2]))

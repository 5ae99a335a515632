"""Device selection with clear errors, and where a result was measured."""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import re
import subprocess
from collections.abc import Iterator

import torch

ALLOWED = ("auto", "cpu", "cuda", "cuda:<index>")


def parse_device(device: str | torch.device) -> torch.device | None:
    """``device``'s spelling checked, without looking for the device: None for ``"auto"``,
    else the ``torch.device`` (cpu or cuda); ValueError naming the field and the allowed
    values otherwise."""
    if device == "auto":
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of {', '.join(ALLOWED)}; got {device!r}")
    return dev


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/``None`` picks CUDA when present, else the CPU. Unknown names and CUDA asked
    for on a machine without it raise ``ValueError`` naming the field."""
    dev = parse_device(device) if device is not None else None
    if dev is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here; "
                             "use device='cpu' or 'auto'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device index {dev.index} out of range: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return dev


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def has_bf16(device: torch.device) -> bool:
    """bf16 autocast worth using: a CUDA device with native bf16 (compute capability 8.0,
    Ampere, or newer; ``torch.cuda.is_bf16_supported()`` also says yes where bf16 is only
    emulated), or a CPU with bf16 instructions (:func:`cpu_bf16`)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return device.type == "cpu" and cpu_bf16() is not None


def convs_in_tf32(device: torch.device) -> bool:
    """Does cuDNN run float32 convolutions on ``device`` as TF32 (a 10-bit mantissa)? torch's
    default on GPUs that have TF32 (compute capability 8.0 and up):
    ``torch.backends.cudnn.allow_tf32`` is True, while float32 matmuls stay full float32."""
    return (device.type == "cuda" and torch.backends.cudnn.allow_tf32
            and torch.cuda.get_device_capability(device) >= (8, 0))


#: What :func:`cpu_bf16` looks for, as the start line says it when none is there.
CPU_BF16 = "AVX-512 BF16 or AMX on x86, bf16 on Arm"


def cpu_bf16() -> str | None:
    """The CPU's native bf16 instructions, by name (``"AMX"``, ``"AVX-512 BF16"``,
    ``"Arm bf16"``), or None. oneDNN runs bf16 convolutions and matmuls on them, faster than
    fp32 once the matmuls are big (this model's update at the ladder's minibatch of 4,096;
    chapter 08 times both on the reader's CPU). Never
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``: it says yes on any AVX-512 core, where
    bf16 is emulated; nor autocast merely running (it runs everywhere)."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX-512 BF16"
    if platform.machine().lower() in ("aarch64", "arm64") and _arm_bf16():
        return "Arm bf16"
    return None


def _arm_bf16() -> bool:
    """An Arm core's bf16 extension (FEAT_BF16), as Linux lists it in /proc/cpuinfo (macOS is
    not probed: fp32 there)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("Features") and "bf16" in line.split() for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Inside: cuDNN picks deterministic algorithms and does not autotune, and inductor compiles
    in its deterministic mode, so running the same code twice (a resumed run in a new process
    too) gives bit-identical results on a GPU: cuDNN's default backward convolution may add in
    a different order from run to run, and inductor otherwise picks each reduction kernel's
    block sizes by timing them, so a process that compiles anew under other load may sum in
    another order. It governs what compiles inside the block: code compiled before it, at the
    same shapes, keeps its kernels (dynamo does not guard on inductor's settings), and a torch
    without inductor's deterministic mode (before 2.10) gets cuDNN's half only. The previous
    settings after. On the CPU, labkit's kernels are deterministic anyway."""
    import torch._inductor.config as inductor

    cudnn = torch.backends.cudnn
    saved = cudnn.deterministic, cudnn.benchmark
    cudnn.deterministic, cudnn.benchmark = True, False
    mode = inductor.patch(deterministic=True) if hasattr(inductor, "deterministic") \
        else contextlib.nullcontext()
    try:
        with mode:
            yield
    finally:
        cudnn.deterministic, cudnn.benchmark = saved


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream: then nothing may read the
    host. False without CUDA (``labkit.doctor.rehearsal`` stands in for torch.cuda's answer while it
    captures on the CPU). Not for a hot path on the CPU: there it raises and catches."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a torch without CUDA, or without a driver
        return False


def synchronize(device: torch.device) -> None:
    """Wait for queued work on ``device``; the only place the harness blocks on the GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: Names the commit where the tree is a copy without ``.git`` (a GPU machine gets one).
COMMIT_ENV = "LABKIT_GIT_COMMIT"


def commit_from_env() -> str:
    """``$LABKIT_GIT_COMMIT``, checked ("" where unset): 7 to 40 hex digits, optionally
    followed by ``-dirty``; it goes into every results file, so nothing else is taken."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given and not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", given):
        raise ValueError(f"{COMMIT_ENV}={given[:50]!r} must be a commit: 7 to 40 hex digits "
                         "(git rev-parse HEAD), optionally followed by -dirty")
    return given


def git_commit() -> str:
    """The labkit checkout's commit (short hash); else ``$LABKIT_GIT_COMMIT`` (a full hash is
    shortened); else "unknown". The variable wins where both exist: whoever sets it says which
    commit the tree is."""
    given = commit_from_env()
    if given:
        return given[:7] if re.fullmatch(r"[0-9a-f]{40}", given) else given
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def commits_since(commit: str | None) -> int | None:
    """How many commits this checkout's HEAD is past ``commit`` (a recorded result's, ``-dirty``
    or not), or None where git cannot say: no git or no history here (a tree copied to a GPU
    machine), or a commit this history does not hold."""
    commit = (commit or "").split("-")[0]
    if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
        return None
    try:
        out = subprocess.run(["git", "rev-list", "--count", f"{commit}..HEAD"],
                             capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    count = out.stdout.strip()
    return int(count) if out.returncode == 0 and count.isdigit() else None


def git_commit_source() -> str:
    """Where :func:`git_commit` got the commit, for the metadata: ``git``, or the variable, in
    which case nothing checked that the tree is that commit, unmodified."""
    if os.environ.get(COMMIT_ENV, "").strip():
        return f"{COMMIT_ENV} (the tree was not checked against it: no git here)"
    return "git"


def run_metadata(device: torch.device, profile: str | None = None) -> dict:
    """Where and when a result was measured: the one metadata block of every results file."""
    from .version import __version__

    return {"device": device.type, "device_name": device_name(device),
            "torch": torch.__version__, "labkit": __version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "git_commit": git_commit(), "git_commit_source": git_commit_source(),
            "profile": profile,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}

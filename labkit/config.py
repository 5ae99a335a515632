"""Run configuration: typed, validated, with named presets (profiles)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from .envs.spec import ForageSpec, check_int, check_seed

PROFILES = ("quick", "full")


@dataclass
class RunConfig:
    """What one ladder or training run does. Derived values are computed in ``__post_init__``."""

    n_envs: int = 64
    """Environments stepped in parallel (N)."""
    n_steps: int = 32
    """Rollout length per iteration (T); one iteration = N*T env steps + one PPO update."""
    iterations: int = 3
    """Steady-state iterations timed per stage (the first, warmup, iteration is extra)."""
    seed: int = 1
    """Seed for the envs, the model init and action sampling."""
    scaling_n_envs: tuple[int, ...] = (64, 256, 1024)
    """N values of the scaling sweep (stages >= 3)."""
    stage_timeout_s: float = 120.0
    """A stage stops adding steady-state iterations once this much time was spent (>= 2 run)."""
    spec: ForageSpec = field(default_factory=ForageSpec)
    """The environment."""
    batch_size: int = field(init=False)
    """N*T, derived."""

    def __post_init__(self) -> None:
        check_int("n_envs", self.n_envs, 1, 2**24)
        check_int("n_steps", self.n_steps, 1, 2**20)
        check_int("iterations", self.iterations, 2, 10_000)
        check_seed(self.seed)
        for n in self.scaling_n_envs:
            check_int("scaling_n_envs", n, 1, 2**24)
        if self.stage_timeout_s <= 0:
            raise ValueError(f"stage_timeout_s must be > 0, got {self.stage_timeout_s}")
        self.batch_size = self.n_envs * self.n_steps

    @classmethod
    def from_profile(cls, name: str, **overrides) -> RunConfig:
        """Named presets: ``quick`` (CPU/CI, minutes on 2 cores) and ``full`` (GPU)."""
        presets = {
            "quick": dict(n_envs=32, n_steps=64, iterations=2,
                          scaling_n_envs=(16, 64, 256), stage_timeout_s=30.0),
            "full": dict(n_envs=1024, n_steps=128, iterations=5,
                         scaling_n_envs=(256, 1024, 4096, 16384, 65536), stage_timeout_s=120.0),
        }
        if name not in presets:
            raise ValueError(f"profile must be one of {', '.join(PROFILES)}; got {name!r}")
        return cls(**{**presets[name], **overrides})

    def replace(self, **changes) -> RunConfig:
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["spec"] = asdict(self.spec)
        return {f.name: out[f.name] for f in fields(self)}

"""The RL benchmark's settings: one typed config, composed by Hydra from
``recipes/bench/rl.yaml`` and a scenario file, then command-line overrides."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tensorhub.bench.payload import parse_size

SCENARIOS = {"standalone": ("broadcast", "tensorhub"), "elastic": ("p2p", "tensorhub"),
             "crossdc": ("broadcast", "tensorhub")}
METRICS = {"standalone": "total_stall_s", "elastic": "update_s", "crossdc": "rollout_stall_s"}
HOSTS = ("netns", "local")
RECIPES = Path(__file__).resolve().parents[3] / "recipes" / "bench"  # the source tree (editable install)


@dataclass(kw_only=True, slots=True)
class RLBenchConfig:
    scenario: str = "standalone"
    methods: list[str] = field(default_factory=lambda: ["broadcast", "tensorhub"])
    rollouts: int = 4
    size: int = 256 << 20
    link: str = "1gbit"
    zone_link: str = "100mbit"
    steps: int = 4
    step_s: float = 2.0
    gen_median_s: float = 2.0
    gen_sigma: float = 0.8
    seed: int = 1
    chunk_size: int = 4 << 20
    chunk_timeout_s: float = 10.0  # a READ making no progress this long counts as a lost source
    lease_ttl_s: float = 10.0  # the server's read leases (also bound each READ's deadline)
    hosts: str = "netns"
    retain: int = 1
    spot: int = 0
    wave: int = 1
    waves: int = 0
    replace_after_s: float = 6.0
    out: str = "bench-results/rl"
    trace: str = ""  # a folder: per-process logs of every pull (tensorhub.bench.rl.trace); empty: off
    # Each step writes this share of the bytes (1: all of them); and TensorHub's
    # trainer publishes each version with its delta (keeping a copy of the last
    # one), rollouts pulling only that where they hold the version before.
    changed: float = 1.0
    delta: bool = False
    # LoRA mode (tensorhub.bench.rl.lora; standalone, elastic): > 0, the base
    # (``size`` bytes) is frozen and each step makes only an all-linear adapter
    # of this rank, of a decoder of ``lora_layers`` layers filling the base.
    lora_rank: int = 0
    lora_layers: int = 28

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise ValueError(f"scenario {self.scenario!r} is not one of {', '.join(SCENARIOS)}")
        bad = [m for m in self.methods if m not in SCENARIOS[self.scenario]]
        if bad or not self.methods:
            raise ValueError(f"scenario {self.scenario} runs methods {list(SCENARIOS[self.scenario])}, not {bad or '[]'}")
        if self.hosts not in HOSTS:
            raise ValueError(f"hosts {self.hosts!r} is not one of {', '.join(HOSTS)}")
        if self.scenario == "crossdc" and self.hosts != "netns":
            raise ValueError("scenario crossdc needs emulated hosts (hosts=netns, root): zones are links")
        if not 0 < self.changed <= 1:
            raise ValueError(f"changed must be in (0, 1], not {self.changed}")
        if self.rollouts < 1 or self.steps < 1 or self.size < 1 << 20:
            raise ValueError("rollouts and steps must be >= 1 and size >= 1MiB")
        if min(self.step_s, self.gen_median_s, self.gen_sigma, self.replace_after_s) < 0:
            raise ValueError("times and gen_sigma must be >= 0")
        if not 0 <= self.spot <= self.rollouts or self.wave < 1 or self.waves < 0:
            raise ValueError("need 0 <= spot <= rollouts, wave >= 1 and waves >= 0")
        if self.scenario == "elastic" and self.waves and self.spot < self.wave:
            raise ValueError(f"a preemption wave of {self.wave} needs at least that many spot rollouts (spot={self.spot})")

        if self.lora_rank < 0 or self.lora_layers < 1:
            raise ValueError("need lora_rank >= 0 (0: off) and lora_layers >= 1")
        if self.lora_rank:
            if self.scenario == "crossdc":
                raise ValueError("LoRA mode (lora_rank > 0) runs scenarios standalone and elastic, not crossdc")
            if self.delta or self.changed != 1:
                raise ValueError("LoRA mode writes the whole adapter each step: no delta, changed=1")

    @property
    def metric(self) -> str:
        return METRICS[self.scenario]

    @classmethod
    def from_dict(cls, values: dict) -> RLBenchConfig:
        """Build from plain values (a Hydra node): sizes may be strings ('256MiB');
        an unknown key is an error that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"RLBenchConfig has no field(s) {unknown}; known: {sorted(known)}")
        values = dict(values)
        for key in ("size", "chunk_size"):
            if isinstance(values.get(key), str):
                values[key] = parse_size(values[key])
        kinds = {f.name: f.type for f in fields(cls)}  # annotations are strings (postponed evaluation)
        for key, value in values.items():
            kind = {"int": int, "float": float, "str": str}.get(kinds[key])
            if kind is not None and not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
                try:
                    values[key] = kind(value)
                except (TypeError, ValueError):
                    raise ValueError(f"RLBenchConfig.{key} must be {kinds[key]}, not {value!r}") from None
        if "methods" in values:
            values["methods"] = list(values["methods"])
        return cls(**values)

    def params(self) -> dict:
        """The parameters that shape a run, for the JSON rows."""
        out = asdict(self)
        for key in ("methods", "out", "trace"):
            out.pop(key)
        if self.scenario != "elastic":
            for key in ("spot", "wave", "waves", "replace_after_s"):
                out.pop(key)
        if self.scenario != "crossdc":
            out.pop("zone_link")
        if not self.lora_rank:
            out.pop("lora_layers")
        return out


def compose(overrides: list[str], *, config_dir: str | Path | None = None) -> RLBenchConfig:
    """Hydra composition of ``rl.yaml`` (+ ``scenario=...``) with ``overrides``
    (``key=value`` strings, as on Hydra's command line)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    where = Path(config_dir or RECIPES).resolve()
    if not (where / "rl.yaml").is_file():
        raise FileNotFoundError(f"no rl.yaml in {where}: pass the recipes folder (recipes/bench of the source tree)")
    with initialize_config_dir(config_dir=str(where), version_base=None):
        cfg = hydra_compose(config_name="rl", overrides=list(overrides))
    return RLBenchConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))

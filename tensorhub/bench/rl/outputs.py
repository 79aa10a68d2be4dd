"""What a run leaves behind: ``rl-<scenario>.json`` (the rows), ``.md`` (the
comparison table) and ``.png`` (stall per step for each method, and a timeline
of which process holds which version), all in ``cfg.out``."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from tensorhub.bench.rl import lora, metrics
from tensorhub.bench.rl.config import SCENARIOS, RLBenchConfig

MEANING = {
    "total_stall_s": "trainer + rollout seconds not computing or generating, per step (median)",
    "update_s": "seconds from a joining rollout's request until it holds the newest version (median)",
    "rollout_stall_s": "rollout seconds not generating, per step (median)",
}


def baseline(cfg: RLBenchConfig) -> str:
    return SCENARIOS[cfg.scenario][0]


def one_line(row: dict, metric: str) -> str:
    return (f"{row['scenario']} / {row['method']}: {metric} = {row[metric]:.2f} s; trainer stall per step "
            f"{row['trainer_stall_s']:.2f} s, rollout stall per step {row['rollout_stall_s']:.2f} s, "
            f"{row['steps_s']:.1f} s for the steps, {row['batches']} batches, staleness {row['mean_staleness']}")


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f}"


def _copies(nbytes: int | None, size: int) -> str:
    return "n/a" if nbytes is None else f"{nbytes / size:.2f}"


def _sent(cfg: RLBenchConfig, row: dict) -> str:
    if cfg.lora_rank:
        ratio = row.get("egress_per_step_vs_adapter")
        return "n/a" if ratio is None else f"{ratio:.3f}"
    return _copies(row.get("trainer_egress_bytes"), cfg.size)


def markdown(cfg: RLBenchConfig, rows: list[dict]) -> str:
    metric, base = cfg.metric, baseline(cfg)
    cols = ["method", f"**{metric}**", f"vs {base}", "trainer stall / step", "rollout stall / step"]
    cols += ["joins"] if cfg.scenario == "elastic" else []
    # LoRA mode: a step makes an adapter, so the trainer's egress is counted in adapters per step
    sent = "trainer sent / step (adapters)" if cfg.lora_rank else "trainer sent (versions)"
    cols += ["seconds for the steps", "batches", "mean staleness", sent]
    cols += ["across zones (versions)"] if cfg.scenario == "crossdc" else []
    cols += ["MiB from trainer", "MiB from rollouts", "retries"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        ratio = metrics.ratio(rows, metric, base, r["method"]) if r["method"] != base else None
        cells = [f"`{r['method']}`", f"{r[metric]:.2f} s", f"{ratio:.2f}x less" if ratio else "",
                 f"{r['trainer_stall_s']:.2f} s", f"{r['rollout_stall_s']:.2f} s"]
        cells += [str(r["joins"])] if cfg.scenario == "elastic" else []
        cells += [f"{r['steps_s']:.1f} s", str(r["batches"]), str(r["mean_staleness"]),
                  _sent(cfg, r)]
        cells += [_copies(r.get("zone_link_bytes"), cfg.size)] if cfg.scenario == "crossdc" else []
        cells += [_mib(r["bytes_from_trainer"]), _mib(r["bytes_from_rollouts"]), str(r["retries"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(cfg: RLBenchConfig, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1 + len(rows), 1, figsize=(10, 3 + 2.2 * len(rows)), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(rows)
    key = "join_update_s" if cfg.scenario == "elastic" else (
        "rollout_stall_per_step_s" if cfg.scenario == "crossdc" else "stall_per_step_s")
    for i, r in enumerate(rows):
        values = r[key]
        ax.bar([1 + x + i * width for x in range(len(values))], values, width, label=r["method"])
    ax.set_xlabel("join" if cfg.scenario == "elastic" else "trainer step")
    ax.set_ylabel("seconds")
    ax.set_title(f"{cfg.scenario}: {key.replace('_', ' ')} ({MEANING[cfg.metric].split(',')[0]})", fontsize=9)
    ax.legend()
    cmap = plt.get_cmap("viridis", cfg.steps + 1)
    for ax, r in zip((a[0] for a in axes[1:]), rows):
        timeline = r["timeline"]
        names = sorted(timeline, key=lambda n: (n != "trainer", n))
        end = r["steps_s"]
        for y, name in enumerate(names):
            marks = timeline[name]
            for (t, version), nxt in zip(marks, [*marks[1:], (end, None)]):
                t = max(t, 0.0)
                if nxt[0] > t and version >= 0:  # -1: preempted, holds nothing
                    ax.broken_barh([(t, nxt[0] - t)], (y - 0.4, 0.8), color=cmap(version % (cfg.steps + 1)))
                    ax.text(t + 0.05, y, str(version), va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xlim(0, max(end, 1e-3))
        ax.set_title(f"{r['method']}: version held (trainer: published) over seconds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_all(cfg: RLBenchConfig, rows: list[dict]) -> dict[str, Path]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"rl-{cfg.scenario}.{ext}" for ext in ("json", "md", "png")}
    base = baseline(cfg)
    meta = {"benchmark": "rl", "scenario": cfg.scenario, "metric": cfg.metric, "meaning": MEANING[cfg.metric],
            "baseline": base, "ratio": metrics.ratio(rows, cfg.metric, base)}
    paths["json"].write_text(json.dumps({"results": rows, **meta}, indent=2) + "\n")
    paths["md"].write_text(markdown(cfg, rows))
    plot(cfg, rows, paths["png"])
    return paths


def print_summary(console: Console, cfg: RLBenchConfig, rows: list[dict], paths: dict[str, Path]) -> None:
    links = f"links {cfg.link}" if cfg.hosts == "netns" else "one host, no link caps"
    console.print(f"[bold]{cfg.scenario}[/]: {cfg.rollouts} rollouts, {cfg.size / 2**20:,.0f} MiB versions, {links}"
                  + (f", {cfg.zone_link} between zones" if cfg.scenario == "crossdc" else "")
                  + (f"; LoRA mode: the base once, then a rank-{cfg.lora_rank} adapter of "
                     f"{lora.adapter_bytes(cfg) / 2**20:,.2f} MiB per step" if cfg.lora_rank else "")
                  + f"; {cfg.metric} = {MEANING[cfg.metric]}")
    console.print(markdown(cfg, rows), markup=False, highlight=False, soft_wrap=True)
    ratio = metrics.ratio(rows, cfg.metric, baseline(cfg))
    if ratio:
        console.print(f"tensorhub: {ratio:.2f}x less {cfg.metric} than {baseline(cfg)}")
    console.print(f"results: {paths['json']}, table: {paths['md']}, plot: {paths['png']}")

"""`prl plot RUN [--compare RUN2 ...] [-o FILE]`: one PNG of a run's progress, step by step.

Panels: reward (with min-max band), eval reward, policy lag, trainer tokens/s, trainer step
time, weight-sync time per step (mean over inference servers), trainer loss and entropy (an
SFT run's curve: it has no rewards). With `--compare` every run
is drawn on the same axes in its own colour. A panel whose metric no run has says so.

matplotlib (the `plot` extra) is imported here only, with the Agg backend: no display needed
on a login node. The PNG is written atomically (a reader never sees half an image).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from prl.errors import ConfigError, needs_extra
from prl.ops.metrics import series, step_rows
from prl.run.rundir import RunDir, atomic_write_bytes


@dataclass(frozen=True)
class Panel:
    title: str
    key: str
    band: tuple[str, str] | None = None
    """Keys of a lower and upper bound drawn as a shaded band around `key`."""
    ylabel: str = ""


PANELS = (
    Panel("reward", "orchestrator/reward_mean", ("orchestrator/reward_min", "orchestrator/reward_max")),
    Panel("eval reward", "eval/reward_mean", ("eval/reward_min", "eval/reward_max")),
    Panel("policy lag (steps)", "orchestrator/policy_lag_mean"),
    Panel("trainer tokens/s", "trainer/tokens_per_s"),
    Panel("trainer step time", "trainer/step_s", ylabel="s"),
    Panel("weight sync per step", "inference/weight_update_s", ylabel="s"),
    Panel("trainer loss", "trainer/loss"),
    Panel("trainer entropy", "trainer/entropy"),
)


def load_rows(run: RunDir) -> dict[int, dict[str, float]]:
    rows = step_rows(run.read_metrics())
    if not rows:
        raise ConfigError(f"{run.root}: no metrics yet ({run.metrics_jsonl} is empty or missing)")
    return rows


def render_png(runs: list[tuple[str, dict[int, dict[str, float]]]]) -> bytes:
    """The figure for (label, rows) of each run, as PNG bytes."""
    matplotlib = needs_extra("matplotlib", "plot", "prl plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 2
    fig, axes = plt.subplots((len(PANELS) + cols - 1) // cols, cols, figsize=(12, 3.2 * len(PANELS) / cols),
                             squeeze=False)
    legend = False
    try:
        for ax, panel in zip(axes.flat, PANELS):
            drawn = False
            for index, (label, rows) in enumerate(runs):
                steps, values = series(rows, panel.key)
                if not steps:
                    continue
                colour = f"C{index}"
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, color=colour, label=label)
                if panel.band:
                    lo, hi = (dict(zip(*series(rows, k))) for k in panel.band)
                    shared = [s for s in steps if s in lo and s in hi]
                    if shared:
                        ax.fill_between(shared, [lo[s] for s in shared], [hi[s] for s in shared],
                                        color=colour, alpha=0.15, linewidth=0)
                drawn = True
            ax.set_title(panel.title)
            ax.set_xlabel("step")
            if panel.ylabel:
                ax.set_ylabel(panel.ylabel)
            if not drawn:
                ax.text(0.5, 0.5, f"no {panel.key} in metrics.jsonl", ha="center", va="center",
                        transform=ax.transAxes, color="grey")
            elif len(runs) > 1 and not legend:
                ax.legend(fontsize="small")  # once: the colours mean the same runs in every panel
                legend = True
            ax.grid(alpha=0.3)
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=80)
        return out.getvalue()
    finally:
        plt.close(fig)


def plot(run: RunDir, compare: list[RunDir], output: Path | None) -> Path:
    """Write the PNG for `run` (and `compare` overlaid); return its path."""
    runs = [(_label(r, [run, *compare]), load_rows(r)) for r in (run, *compare)]
    path = output or run.progress_png
    # Inside the run directory a file is private like the rest of it; elsewhere it is the user's to share.
    mode = 0o600 if output is None else 0o644
    try:
        atomic_write_bytes(path, render_png(runs), mode=mode)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror}") from None
    return path


def _label(run: RunDir, runs: list[RunDir]) -> str:
    """The shortest tail of the run's path that tells it apart from the other runs."""
    parts = run.root.parts
    for n in range(1, len(parts) + 1):
        tail = parts[-n:]
        if sum(r.root.parts[-n:] == tail for r in runs) == 1:
            return "/".join(tail)
    return str(run.root)

"""The run's plot: reward, entropy, KL and grad norm (and the critic's curves), raw and smoothed.
matplotlib is optional (the ``[examples]`` extra): imported when a plot is drawn."""

from __future__ import annotations

from pathlib import Path

from toy.settings import FINAL_WINDOW


def smooth(values: list[float], window: int = FINAL_WINDOW) -> list[float]:
    """Trailing moving average over ``window`` steps (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, title: str) -> None:
    """Title ``fig``, lay it out, write it to ``path`` (100 dpi) and close it."""
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def write_plot(rows: list[dict], path: Path, *, title: str, target: float, chance: float, critic: bool = False) -> None:
    """Four panels (reward, entropy, KL, grad norm), with ``critic`` six (value loss, explained
    variance); raw points and a smoothed line, the verdict in the title."""
    plt = pyplot()
    panels = [
        ("reward", "mean reward (fraction of tokens right)"),
        ("entropy", "entropy (nats / token)"),
        ("kl_loss", "KL to reference, k3 (nats / token)"),
        ("grad_norm", "grad norm before clipping (L2)"),
    ]
    if critic:
        panels += [
            ("vf_loss", "critic: clipped value loss"),
            ("vf_explained_var", "critic: explained variance (axis from -1)"),
        ]
    fig, axes = plt.subplots(2, len(panels) // 2, figsize=(5.5 * len(panels) // 2, 7))
    steps = [r["step"] for r in rows]
    for ax, (key, label) in zip(axes.flat, panels, strict=True):
        raw = [float(r.get(key, float("nan"))) for r in rows]
        ax.plot(steps, raw, ".", color="tab:blue", alpha=0.35, label="per step")
        ax.plot(steps, smooth(raw), "-", color="tab:blue", label=f"mean of last {FINAL_WINDOW} steps")
        ax.set_ylabel(label)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if key == "vf_explained_var":
            ax.set_ylim(-1.0, 1.05)  # the first steps' large negative values would flatten the rest
        if key == "reward":
            ax.set_ylim(0.0, 1.0)
            ax.axhline(target, color="tab:green", ls="--", label=f"target {target:g}")
            ax.axhline(chance, color="tab:gray", ls=":", label=f"chance 1/{round(1 / chance)}")
            ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path, title)

"""The planner's figure: simulated max context per configuration, one bar each.

``python -m bench plan`` computes the plan; drawing it belongs here with the suite's other
figures, so the benchmark holds no plotting code.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the non-interactive backend

from records import human  # noqa: E402


def draw_plan(entries: list[tuple[str, int]], title: str, path: Path) -> Path:
    """A horizontal bar per ``(label, max_context tokens)``, labelled with the length."""
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(entries) + 1.5))
    labels = [label for label, _ in entries]
    values = [tokens / 2**20 for _, tokens in entries]
    ax.barh(labels, values, color="tab:blue")
    for i, (_, tokens) in enumerate(entries):
        ax.text(tokens / 2**20, i, f" {human(tokens) if tokens else '0'}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("simulated max context (M tokens, K = 1024)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

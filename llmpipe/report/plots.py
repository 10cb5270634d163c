"""Shared finishing of the workflow's matplotlib figures (labels, grid, legend or an 'empty' note, PNG file)."""

from __future__ import annotations

import os


def finish_and_save(fig, ax, png: str, *, xlabel: str, ylabel: str, title: str, has_data: bool,
                    empty_text: str, grid_which: str = "major") -> None:
    """Label ``ax``, add a grid and a legend (or ``empty_text`` in the middle when ``has_data`` is false), and
    write ``fig`` to ``png`` (folders created, 120 dpi), then close it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which=grid_which, alpha=0.3)
    if has_data:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, empty_text, ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)

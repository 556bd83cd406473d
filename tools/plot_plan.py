#!/usr/bin/python3
"""Draws `wsync plan --plot` charts with matplotlib (Debian: python3-matplotlib).

Usage: plot_plan.py fleet CSV PNG      (deployments,backend,seconds: time per backend
                                        against the number of deployments; a backend
                                        named "published ..." is drawn as points)
       plot_plan.py published CSV PNG  (id,own,backend,published_lo,published_hi,predicted:
                                        predicted against published, log-log, with the
                                        +-25% band around equality)
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def fleet(rows, png):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend in sorted({r["backend"] for r in rows}):
        pts = sorted((int(r["deployments"]), float(r["seconds"])) for r in rows if r["backend"] == backend)
        if backend.startswith("published"):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="*", markersize=12, linestyle="none",
                    label=backend)
        else:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=backend)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("server deployments")
    ax.set_ylabel("predicted sync time (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def published(rows, png):
    fig, ax = plt.subplots(figsize=(7, 6))
    values = []
    for own, marker, label in ((0, "o", "published results"), (1, "s", "wsync's own runs")):
        for r in rows:
            if int(r["own"]) != own:
                continue
            lo, hi, pred = float(r["published_lo"]), float(r["published_hi"]), float(r["predicted"])
            mid = (lo + hi) / 2
            values += [lo, hi, pred]
            ax.errorbar(mid, pred, xerr=[[mid - lo], [hi - mid]], marker=marker, linestyle="none",
                        color="tab:blue" if own == 0 else "tab:orange",
                        label=label if label else None)
            ax.annotate(r["id"], (mid, pred), fontsize=7, xytext=(4, 3), textcoords="offset points")
            label = None
    lo, hi = min(values) / 2, max(values) * 2
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8, label="predicted = published")
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="gray", alpha=0.2,
                    label="within 25%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("published / measured sync time (s)")
    ax.set_ylabel("wsync plan's prediction (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("fleet", "published"):
        sys.exit(__doc__)
    with open(sys.argv[2], newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        sys.exit("plot_plan.py: no rows to plot")
    (fleet if sys.argv[1] == "fleet" else published)(rows, sys.argv[3])


if __name__ == "__main__":
    main()

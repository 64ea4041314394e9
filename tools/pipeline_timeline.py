#!/usr/bin/env python
"""Draw pipeline schedules' timelines and print their bubbles (all five by default, one above the other).

    python tools/pipeline_timeline.py --pp 4 --micro-batches 8 --png timelines.png
    python tools/pipeline_timeline.py --schedule zb-h1 --pp 4 --micro-batches 8 --t-w 0.5
    python tools/pipeline_timeline.py --schedule interleaved --pp 4 --micro-batches 8 --vpp 2 --png t.png

Costs are per whole stage: a forward t_f, an input-gradient backward t_b, a weight-gradient pass
t_w (a whole backward, as 1F1B runs it, is t_b + t_w). Qi et al. 2024 measure t_f ~ t_b ~ t_w.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.files import atomic_output  # noqa: E402
from megalite.errors import ConfigError, entry_point, one_line_arguments  # noqa: E402
from megalite.pipeline.schedules import SCHEDULES  # noqa: E402
from megalite.pipeline.simulate import Timeline, ascii_timeline, simulate  # noqa: E402

ORDER = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
COLORS = {"F": "tab:blue", "B": "tab:red", "b": "tab:orange", "W": "tab:green"}  # B whole, b input-grad only


def closed_form(schedule: str, p: int, m: int, v: int, t_f: float, t_b: float, t_w: float) -> str:
    """The paper's bubble fraction where one exists (Narayanan et al. 2021; Qi et al. 2024)."""
    t = t_f + t_b + t_w
    if schedule in ("gpipe", "1f1b", "interleaved"):
        return f"{100 * (p - 1) / (v * m + p - 1):.1f}%"
    if schedule == "zb-h1":
        idle = (p - 1) * (t_f + t_b - t_w)
        return f"{100 * idle / (m * t + idle):.1f}%"
    return "n/a"


def draw(timelines: list[tuple[str, Timeline]], p: int, m: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(tl.step_time for _, tl in timelines)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(14, 0.9 + 0.45 * p * len(timelines)), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines):
        for e in tl.events:
            key = "b" if e.split else e.action[0]
            ax.barh(e.rank, e.end - e.start, left=e.start, color=COLORS[key], edgecolor="white")
            ax.text((e.start + e.end) / 2, e.rank, str(e.action[1]), ha="center", va="center", fontsize=6)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.set_xlim(0, end)
        ax.invert_yaxis()
        ax.set_title(f"{name}: bubble {100 * tl.bubble_fraction:.1f}%", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (one stage's forward = 1); blue F, red whole B, orange B (input grad), green W")
    fig.suptitle(f"P={p} M={m}")
    fig.tight_layout()
    with atomic_output(path) as tmp:  # an existing PNG is replaced only by a complete one
        fig.savefig(tmp, dpi=110, format=os.path.splitext(path)[1].lstrip(".") or "png")


# The simulation walks every (stage, micro-batch, chunk) operation; these keep it to seconds and the
# printed timeline to something a terminal shows.
LIMITS = {"--pp": 32, "--micro-batches": 128, "--vpp": 4}


def check_args(args: argparse.Namespace) -> None:
    """Sizes and times the simulation can use, or ConfigError naming the flag."""
    for flag, value in (("--pp", args.pp), ("--micro-batches", args.micro_batches), ("--vpp", args.vpp)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
        if value > LIMITS[flag]:
            raise ConfigError(f"{flag} {value} must be at most {LIMITS[flag]} (a timeline beyond that takes minutes "
                              "to simulate and cannot be read)")
    for flag, value in (("--t-forward", args.t_f), ("--t-backward", args.t_b), ("--t-weight", args.t_w)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} {value} must be a positive finite time")
    if args.schedule in ("interleaved", "all") and (args.vpp < 2 or args.micro_batches % args.pp):
        raise ConfigError(f"--schedule interleaved needs --vpp >= 2 and --micro-batches a multiple of --pp "
                          f"(got --vpp {args.vpp}, --micro-batches {args.micro_batches}, --pp {args.pp})")


@entry_point
def main(argv: list[str] | None = None) -> int:
    ap = one_line_arguments(argparse.ArgumentParser(description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--schedule", choices=["all", *SCHEDULES], default="all")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--vpp", type=int, default=2, help="chunks per rank of the interleaved schedule (zbv: always 2)")
    ap.add_argument("--t-forward", "--t-f", dest="t_f", type=float, default=1.0, help="time of one stage's forward")
    ap.add_argument("--t-backward", "--t-b", dest="t_b", type=float, default=1.0,
                    help="time of one stage's input-gradient backward (B); a whole backward takes B + W")
    ap.add_argument("--t-weight", "--t-w", dest="t_w", type=float, default=1.0,
                    help="time of one stage's weight-gradient backward (W)")
    ap.add_argument("--png", help="also write the timelines as a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    check_args(args)
    p, m = args.pp, args.micro_batches
    names = ORDER if args.schedule == "all" else (args.schedule,)
    timelines = []
    for name in names:
        v = {"interleaved": args.vpp, "zbv": 2}.get(name, 1)
        try:
            tl = simulate(name, p, m, v, args.t_f, args.t_b, args.t_w)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        timelines.append((name, tl))
        print(ascii_timeline(tl, p))
        print(f"{name}: P={p} M={m} v={v}: bubble {100 * tl.bubble_fraction:.1f}% of the step "
              f"(closed form {closed_form(name, p, m, v, args.t_f, args.t_b, args.t_w)})\n")
    if args.png:
        draw(timelines, p, m, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

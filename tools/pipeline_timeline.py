#!/usr/bin/env python
"""Draw a pipeline schedule's timeline and print its bubble.

    python tools/pipeline_timeline.py --schedule 1f1b --pp 4 --micro-batches 8
    python tools/pipeline_timeline.py --schedule interleaved --pp 4 --micro-batches 8 --vpp 2 --png t.png
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.files import atomic_output  # noqa: E402
from megalite.errors import ConfigError, entry_point, one_line_arguments  # noqa: E402
from megalite.pipeline.simulate import ascii_timeline, simulate  # noqa: E402


def check_args(args: argparse.Namespace) -> None:
    """Sizes and times the simulation can use, or ConfigError naming the flag."""
    for flag, value in (("--pp", args.pp), ("--micro-batches", args.micro_batches), ("--vpp", args.vpp)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    for flag, value in (("--t-forward", args.t_forward), ("--t-backward", args.t_backward)):
        if not 0 < value < float("inf"):
            raise ConfigError(f"{flag} {value} must be a positive finite time")
    if args.schedule == "interleaved" and (args.vpp < 2 or args.micro_batches % args.pp):
        raise ConfigError(f"--schedule interleaved needs --vpp >= 2 and --micro-batches a multiple of --pp "
                          f"(got --vpp {args.vpp}, --micro-batches {args.micro_batches}, --pp {args.pp})")


@entry_point
def main(argv: list[str] | None = None) -> int:
    ap = one_line_arguments(argparse.ArgumentParser(description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--t-forward", type=float, default=1.0)
    ap.add_argument("--t-backward", type=float, default=2.0)
    ap.add_argument("--png", help="also write the timeline as a PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    check_args(args)
    vpp = args.vpp if args.schedule == "interleaved" else 1
    try:
        tl = simulate(args.schedule, args.pp, args.micro_batches, vpp, args.t_forward, args.t_backward)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(ascii_timeline(tl, args.pp))
    p, m = args.pp, args.micro_batches
    closed = (p - 1) / (vpp * m + p - 1)
    print(f"{args.schedule}: P={p} M={m} v={vpp}: bubble {100 * tl.bubble_fraction:.1f}% of the step "
          f"(closed form (P-1)/(v*M+P-1) = {100 * closed:.1f}%)")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(12, 0.5 + 0.5 * p))
        for e in tl.events:
            color = "tab:blue" if e.action[0] == "F" else "tab:orange"
            ax.barh(e.rank, e.end - e.start, left=e.start, color=color, edgecolor="white")
            ax.text((e.start + e.end) / 2, e.rank, str(e.action[1]), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(p), [f"stage {r}" for r in range(p)])
        ax.invert_yaxis()
        ax.set_xlabel("time (forward = 1)")
        ax.set_title(f"{args.schedule} P={p} M={m} v={vpp}: bubble {100 * tl.bubble_fraction:.1f}%")
        fig.tight_layout()
        with atomic_output(args.png) as tmp:  # an existing PNG is replaced only by a complete one
            fig.savefig(tmp, dpi=120, format=os.path.splitext(args.png)[1].lstrip(".") or "png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU threads x processes vs cores, and OpenMP's wait policy: what a step costs when processes share cores.

Starts P worker processes at once (as torchrun would; one set per wait policy, which OpenMP reads when it
loads), each running the same small training step (a stack of Llama-sized MLP blocks on 1024 tokens of
hidden 256, forward + backward + SGD, fp32: the regime of the demo model, where OpenMP's fork/join
barriers are frequent) with T intra-op threads for each T in turn. Reports per configuration the median
step time of a process and the CPU seconds it burnt per step (all its threads), over interleaved repeats
(the order rotates each repeat, so machine-wide load drift hits all configurations alike). The load average is recorded: on a shared machine
compare configurations side by side, not with another day's run.

    python bench/threads.py                       # P in 1,2,4; T in 1, cores/P, cores; both policies
    python bench/threads.py --smoke               # P = 1, tiny dims: one worker per wait policy
    python bench/threads.py --out bench/results   # update the published table
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results_io import spread, write_results  # noqa: E402

POLICIES = ("default", "PASSIVE")


def worker(thread_counts: list[int], steps: int, warmup: int, tokens: int, hidden: int, layers: int) -> None:
    """One process: import torch, say so, wait for the start line on stdin (the workers of every group start
    together, so their imports overlap; timing begins once all have loaded, and only the running group
    computes); then for each thread count, warm
    up, wait for the go line (so that every worker times the same interval), time `steps` steps and print one
    JSON line."""
    import torch

    print("loaded", flush=True)
    sys.stdin.readline()  # nothing computes before this (an idle OpenMP pool may spin for a while)
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                  torch.nn.Linear(4 * hidden, hidden)) for _ in range(layers)]
    model = torch.nn.Sequential(*blocks)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(tokens, hidden)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    for threads in thread_counts:
        torch.set_num_threads(threads)
        for _ in range(warmup):
            step()
        print("ready", flush=True)
        sys.stdin.readline()
        walls, cpus = [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        print(json.dumps({"threads": torch.get_num_threads(), "wall_s": walls, "cpu_s": cpus}), flush=True)


def start_group(processes: int, policy: str, counts: list[int], args: argparse.Namespace) -> list[subprocess.Popen]:
    """P workers with one wait policy (fixed when a process loads OpenMP); they import torch, then wait to be run."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = str(max(counts))
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, __file__, "--worker", "--thread-counts", ",".join(map(str, counts)),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--layers", str(args.layers)]
    return [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(processes)]


def _send(procs: list[subprocess.Popen], line: str) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()


def run_group(procs: list[subprocess.Popen], counts: list[int]) -> dict[int, dict[str, float]]:
    """Run a started group, each thread count in turn: per count, the medians over processes of their median
    step time and CPU seconds per step."""
    _send(procs, "start")
    out: dict[int, dict[str, float]] = {}
    for threads in counts:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", "a worker failed"
        _send(procs, "go")
        results = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
        assert all(r["threads"] == threads for r in results)
        out[threads] = {"step_s": statistics.median(statistics.median(r["wall_s"]) for r in results),
                        "cpu_s_per_step": statistics.median(statistics.median(r["cpu_s"]) for r in results)}
    for p in procs:
        p.communicate()
        if p.returncode:
            raise SystemExit(f"a worker failed ({p.returncode})")
    return out


def thread_counts(cores: int, processes: int) -> list[int]:
    """1, cores // P (megalite's default) and cores (torch's default)."""
    return sorted({1, max(1, cores // processes), cores})


def to_markdown(res: dict[str, Any]) -> str:
    lines = [f"# Threads x processes on {res['cores']} cores ({res['date']}, {res['machine']}, torch {res['torch']})",
             "",
             f"{res['repeats']} interleaved repeats x {res['steps']} steps of {res['layers']} MLP blocks, "
             f"{res['tokens']} tokens x hidden {res['hidden']}, fp32. Load average before / after: "
             f"{res['load_before']} / {res['load_after']}. Step time and CPU per step: median over processes, "
             "then min / median / max over repeats. 'x default' = step time / that of megalite's default "
             "(T = cores // P, passive) at the same P.",
             "",
             "| processes | threads each | OMP_WAIT_POLICY | step s (min / median / max) | CPU s per step | x default |",
             "|---|---|---|---|---|---|"]
    for row in res["rows"]:
        s, c = row["step_s"], row["cpu_s_per_step"]
        mark = " (megalite default)" if row["is_default"] else ""
        lines.append(f"| {row['processes']} | {row['threads']}{mark} | {row['policy']} | "
                     f"{s['min']:.4f} / {s['median']:.4f} / {s['max']:.4f} | {c['median']:.4f} | "
                     f"{row['vs_default']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--thread-counts", default="1", help=argparse.SUPPRESS)
    ap.add_argument("--processes", default="1,2,4", help="comma-separated process counts")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="P = 1 only; 2 steps, 1 repeat, tiny dims")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/bench"))
    a = ap.parse_args(argv)
    if a.worker:
        worker([int(t) for t in a.thread_counts.split(",")], a.steps, a.warmup, a.tokens, a.hidden, a.layers)
        return
    if a.smoke:
        a.processes, a.steps, a.warmup, a.repeats, a.tokens, a.hidden, a.layers = "1", 2, 1, 1, 64, 32, 1
    from megalite.runtime.threads import available_cores

    cores = available_cores()
    groups = [(p, policy) for p in (int(x) for x in a.processes.split(",")) for policy in POLICIES]
    load_before = os.getloadavg()
    samples: dict[tuple[int, int, str], list[dict[str, float]]] = {}
    for r in range(a.repeats):
        order = groups[r % len(groups):] + groups[:r % len(groups)]  # rotate the order each repeat
        started = [start_group(p, policy, thread_counts(cores, p), a) for p, policy in order]
        for proc in (q for procs in started for q in procs):  # no import left running while a group is timed
            assert proc.stdout is not None and proc.stdout.readline().strip() == "loaded", "a worker failed"
        for (p, policy), procs in zip(order, started):
            for t, m in run_group(procs, thread_counts(cores, p)).items():
                samples.setdefault((p, t, policy), []).append(m)
                print(f"repeat {r + 1}/{a.repeats}: P={p} T={t} {policy}: {m['step_s']:.4f} s/step, "
                      f"{m['cpu_s_per_step']:.4f} CPU s/step", file=sys.stderr, flush=True)
    rows = []
    for (p, t, policy), ms in sorted(samples.items()):
        rows.append({"processes": p, "threads": t, "policy": policy,
                     "is_default": t == max(1, cores // p) and policy == "PASSIVE",
                     "step_s": spread([m["step_s"] for m in ms]),
                     "cpu_s_per_step": spread([m["cpu_s_per_step"] for m in ms])})
    for row in rows:
        base = next(x for x in rows if x["processes"] == row["processes"] and x["is_default"])
        row["vs_default"] = row["step_s"]["median"] / base["step_s"]["median"]
    import torch

    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "smoke": a.smoke,
           "machine": f"{platform.machine()} {platform.processor()}".strip(), "cores": cores,
           "torch": torch.__version__, "steps": a.steps, "repeats": a.repeats, "tokens": a.tokens,
           "hidden": a.hidden, "layers": a.layers, "load_before": [round(x, 1) for x in load_before],
           "load_after": [round(x, 1) for x in os.getloadavg()], "rows": rows}
    write_results(Path(a.out), "threads_smoke" if a.smoke else "threads", res, to_markdown)


if __name__ == "__main__":
    main()

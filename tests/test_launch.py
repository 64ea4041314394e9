"""The launchers, run for real: a two-node torchrun job emulated on loopback, and `launch/slurm.sbatch`
submitted to a single-node Slurm cluster that the test starts itself from Debian's packages.

The Slurm test skips (with the reason) where it cannot run: Slurm not installed and installing it not
allowed (the suite installs system packages only when MEGALITE_TESTS_MAY_INSTALL=1, as `.ci/run`
sets), not root, no apt-get or no network for the packages, an unresolvable hostname, or daemons that
are not idle within 120 s. Every wait has a hard deadline; daemons are stopped by the PIDs in their pid
files.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from megalite.data import prepare_demo_data
from tests.conftest import SMALL_RUN

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
SLURM_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
MAY_INSTALL = "MEGALITE_TESTS_MAY_INSTALL"  # "1": the Slurm test may apt-get its daemons (CI sets it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGALITE_FAULT")
           and not k.startswith("SLURM_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)


def _train_args(cache: str, log_dir: Path, *extra: str) -> list[str]:
    return ["--data.cache_dir", cache, *SMALL_RUN, "--logging.dir", str(log_dir), "--train.steps", str(STEPS),
            *extra]


def _check_metrics(log_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


@pytest.fixture(scope="module")
def demo_data(demo_cache_dir: str) -> str:
    """Build the demo corpus once here, so concurrent ranks and jobs only ever read it."""
    prepare_demo_data(demo_cache_dir, 300000, 512)
    return demo_cache_dir


# ------------------------------------------------------------------ multi-node torchrun on loopback

def test_two_torchrun_agents_on_loopback_train(demo_data: str, tmp_path: Path) -> None:
    """`launch/multinode_torchrun.sh` started twice, as two 1-process "nodes" meeting in a c10d
    rendezvous on 127.0.0.1: world 2 as tp=2, so the TP group spans the two nodes (the second node's worker
    has RANK 1 but LOCAL_RANK 0 and LOCAL_WORLD_SIZE 1: a mix-up of global and local rank fails the run);
    both agents exit 0 and metrics are written. One worker per node: the rendezvous of the agents is the
    claim, and more workers per agent are covered by the single-node torchrun tests
    (tests/test_reliability.py, tests/test_stop_signals.py)."""
    env = _env(NNODES="2", NPROC="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               RDZV_ID=f"test-{uuid.uuid4().hex[:8]}", LOCAL_ADDR="127.0.0.1", RDZV_TIMEOUT="600")
    args = _train_args(demo_data, tmp_path / "log", "--parallel.tp", "2")
    agents = [subprocess.Popen(["bash", str(REPO / "launch/multinode_torchrun.sh"), *args], env=env, cwd=str(REPO),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=900)[0])  # a hang guard only, far above a loaded run
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=10)
    assert [a.returncode for a in agents] == [0, 0], "\n----\n".join(outputs)[-4000:]
    _check_metrics(tmp_path / "log")
    config = (tmp_path / "log" / "config.toml").read_text()
    assert "tp = 2" in config


# ------------------------------------------------------------------ a real single-node Slurm

def _install_slurm() -> str | None:
    """None when the daemons are available (installing them if needed), else why not."""
    if all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch", "munged")) or \
            all(Path(p).exists() for p in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged")):
        return None
    if os.environ.get(MAY_INSTALL) != "1":
        return (f"Slurm is not installed; set {MAY_INSTALL}=1 to let the test apt-get install "
                f"{' '.join(SLURM_PACKAGES)} (system packages: what .ci/run does on a throwaway machine)")
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and apt-get (as root) is not available to install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd, limit in ((["apt-get", "update"], 60),
                       (["apt-get", "install", "-y", "--no-install-recommends", *SLURM_PACKAGES], 120)):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=limit)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(cmd[:2])}` took over {limit} s"
        if proc.returncode:
            return f"`{' '.join(cmd[:2])}` failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def test_slurm_is_never_installed_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without MEGALITE_TESTS_MAY_INSTALL=1 a machine without Slurm gets a skip reason, never apt-get."""
    monkeypatch.delenv(MAY_INSTALL, raising=False)
    monkeypatch.setattr(shutil, "which", lambda _: None)  # as on a machine without Slurm
    monkeypatch.setattr(Path, "exists", lambda self: False)

    def no_commands(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the test ran {args[0]!r} without being asked to install anything")

    monkeypatch.setattr(subprocess, "run", no_commands)
    reason = _install_slurm()
    assert reason is not None and f"{MAY_INSTALL}=1" in reason


def _slurm_conf(d: Path, host: str) -> str:
    # config_overrides: the node advertises 4 CPUs whatever the machine has (else a 2-core machine
    # marks it invalid); linuxproc + task/none need no cgroups; MinJobAge keeps the finished job's
    # record long enough to read its state.
    return f"""ClusterName=megalite-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.sock
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_files: list[Path]) -> None:
    """SIGTERM each daemon by the PID in its pid file, then wait (at most 15 s) for all to exit."""
    pids = []
    for pid_file in pid_files:
        try:
            pid = int(pid_file.read_text().split()[0])
            os.kill(pid, 15)
            pids.append(pid)
        except (OSError, ValueError, IndexError):
            continue
    deadline = time.monotonic() + 15
    while pids and time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except OSError:
                pass
        pids = alive
        time.sleep(0.1)


@pytest.fixture(scope="module")
def slurm_env() -> Iterator[dict[str, str]]:
    """A fresh single-node cluster on loopback; yields the environment its clients need."""
    if os.geteuid() != 0:
        pytest.skip("starting Slurm's daemons needs root")
    reason = _install_slurm()
    if reason:
        pytest.skip(f"no Slurm: {reason}")
    host = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(host)
    except OSError:
        pytest.skip(f"hostname {host!r} does not resolve; Slurm's node name (and MASTER_ADDR) must")
    # Not under pytest's 0700 tmp root: munged (running as the munge user) wants every directory on
    # its socket's and log's path searchable.
    d = Path(tempfile.mkdtemp(prefix="megalite-slurm-", dir="/tmp"))
    d.chmod(0o755)
    for sub in ("state", "spool", "munge"):
        (d / sub).mkdir()  # fresh state and spool: a stale DRAIN would come back otherwise
    shutil.chown(d / "munge", "munge", "munge")
    (d / "munge").chmod(0o755)
    conf = d / "slurm.conf"
    conf.write_text(_slurm_conf(d, host))
    env = _env(SLURM_CONF=str(conf))
    pids = [d / "munge" / "munged.pid", d / "slurmctld.pid", d / "slurmd.pid"]
    starts = [["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={d}/munge/munge.sock",
               f"--pid-file={pids[0]}", f"--log-file={d}/munge/munged.log", f"--seed-file={d}/munge/seed"],
              ["/usr/sbin/slurmctld", "-i"], ["/usr/sbin/slurmd"]]
    try:
        for cmd in starts:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                pytest.skip(f"{Path(cmd[-1] if cmd[0] != 'runuser' else cmd[4]).name} did not start: "
                            f"{proc.stderr.strip()[-300:]}")
        deadline = time.monotonic() + 120  # a loaded machine registers the node slowly
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                                   env=env).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                pytest.skip(f"the Slurm node is {state or 'unknown'!r}, not idle, after 120 s")
            time.sleep(0.25)
        yield env
    finally:
        _stop(pids)
        shutil.rmtree(d, ignore_errors=True)


def _job_state(env: dict[str, str], job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "UNKNOWN")


@pytest.mark.timeout(600)  # a fresh machine first installs Slurm from Debian's packages (bounded: 180 s)
def test_slurm_sbatch_trains_with_srun_tasks_and_with_torchrun(slurm_env: dict[str, str], demo_data: str,
                                                              tmp_path: Path) -> None:
    """`sbatch launch/slurm.sbatch` twice, concurrently: LAUNCHER=srun with 2 Slurm tasks (one rank
    each, ranks from SLURM_PROCID), and the default: srun starting one torchrun agent, which meets the job's
    rendezvous on the first node and starts its worker (one: torchrun's workers beyond the first are the
    single-node torchrun tests' claim, tests/test_reliability.py). Both jobs must complete and log."""
    jobs = {}
    common = ["--nodes=1", "--gpus-per-node=0", "--time=30", "--parsable"]
    for name, extra_env, flags in (
            ("srun", {"LAUNCHER": "srun"}, ["--ntasks-per-node=2", "--cpus-per-task=1"]),
            ("torchrun", {"NPROC_PER_NODE": "1"}, ["--ntasks-per-node=1", "--cpus-per-task=1"])):
        out = tmp_path / name
        out.mkdir()
        env = dict(slurm_env, MASTER_PORT=str(_free_port()), **extra_env)
        proc = subprocess.run(["sbatch", *common, *flags, f"--job-name=ml-{name}", f"--output={out}/job.out",
                               str(REPO / "launch/slurm.sbatch"), *_train_args(demo_data, out / "log")],
                              capture_output=True, text=True, env=env, cwd=str(REPO))
        assert proc.returncode == 0, proc.stderr
        jobs[name] = proc.stdout.strip().split(";")[0]
    # Poll scontrol (sbatch --wait is slow to notice the end); MinJobAge keeps the record.
    deadline = time.monotonic() + 600  # a hang guard only: polling ends when both jobs end
    states = {}
    while True:
        states = {name: _job_state(slurm_env, job) for name, job in jobs.items()}
        if all(s not in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") for s in states.values()):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", *jobs.values()], env=slurm_env)
            break
        time.sleep(0.5)
    logs = {name: (tmp_path / name / "job.out").read_text()[-3000:] if (tmp_path / name / "job.out").exists()
            else "" for name in jobs}
    assert states == {"srun": "COMPLETED", "torchrun": "COMPLETED"}, logs
    assert "(srun)" in logs["srun"] and "(torchrun)" in logs["torchrun"]
    for name in jobs:
        _check_metrics(tmp_path / name / "log")

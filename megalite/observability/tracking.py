"""Experiment tracking with Weights & Biases, which must never be able to stop a training run.

* Only one rank logs (`enabled=False` elsewhere) and an empty project turns tracking off.
* No credentials (no `WANDB_API_KEY`, no netrc entry for the wandb host) -> offline mode: the run is
  written under `<log_dir>/wandb` and can be uploaded later with `wandb sync`. A `WANDB_MODE` the user
  set (online, offline, disabled) is always honoured.
* The run id is kept in `<log_dir>/wandb_run_id`, so a run resumed from the same `logging.dir`
  continues the same wandb run (`resume="allow"`) instead of starting a new one.
* Any failure to import, start or log to wandb prints one warning and tracking carries on as a no-op:
  metrics.jsonl and stdout remain the record of truth.
"""

from __future__ import annotations

import netrc
import os
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from megalite.atomic import write_atomic
from megalite.errors import ConfigError

RUN_ID_FILE = "wandb_run_id"
DEFAULT_HOST = "api.wandb.ai"


def has_wandb_credentials(env: Mapping[str, str], netrc_path: Path | None = None) -> bool:
    """True when wandb could log in without prompting: an API key in the environment, or a netrc
    entry for the wandb host (`WANDB_BASE_URL`'s, else api.wandb.ai), as `wandb login` writes."""
    if env.get("WANDB_API_KEY"):
        return True
    base = env.get("WANDB_BASE_URL", "") or DEFAULT_HOST
    host = base.split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    if netrc_path is None:
        netrc_path = Path(env["NETRC"]) if env.get("NETRC") else Path.home() / ".netrc"
    try:
        return netrc.netrc(str(netrc_path)).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(env: Mapping[str, str], netrc_path: Path | None = None) -> Literal["online", "offline"] | None:
    """The `mode` to pass to `wandb.init`: None to honour a user-set WANDB_MODE, else offline
    without credentials and online with them."""
    if env.get("WANDB_MODE"):
        return None
    return "online" if has_wandb_credentials(env, netrc_path) else "offline"


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"comm_bytes": {"tp": 1.0}} -> {"comm_bytes/tp": 1.0}; None values are dropped (e.g. MFU on
    CPU: wandb would chart them as a broken series), and so are strings (labels such as `comm_convention`,
    the same on every step, are not series)."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "/"))
        elif value is not None and not isinstance(value, str):
            flat[name] = value
    return flat


class Tracker:
    """Logs a run's config and per-step metrics to wandb; a no-op when disabled or broken."""

    def __init__(self, project: str, entity: str, run_name: str, config: dict, log_dir: str,
                 enabled: bool) -> None:
        self._run: Any = None
        if not enabled or not project:
            return
        try:
            import wandb
        except Exception as exc:  # ImportError, or a broken install raising anything
            self._warn(f"could not import wandb ({exc}); install it with `pip install wandb`")
            return
        directory = Path(log_dir)
        id_file = directory / RUN_ID_FILE
        try:
            directory.mkdir(parents=True, exist_ok=True)
            run_id = id_file.read_text().strip() if id_file.exists() else ""
            run_id = run_id or uuid.uuid4().hex[:8]
            self._run = wandb.init(project=project, entity=entity or None, name=run_name or None,
                                   config=config, dir=str(directory), id=run_id, resume="allow",
                                   mode=wandb_mode(os.environ))
            write_atomic(id_file, (self._run.id + "\n").encode(), ConfigError)  # never through a link
        except Exception as exc:
            self._warn(f"could not start a wandb run ({exc}); set WANDB_MODE=offline or fix the "
                       f"login (`wandb login`)")
            self._run = None

    @property
    def enabled(self) -> bool:
        return self._run is not None

    @property
    def run_id(self) -> str | None:
        return None if self._run is None else str(self._run.id)

    def log(self, metrics: dict, step: int) -> None:
        """Log one step's metrics (nested dicts flattened to `group/key`)."""
        if self._run is None:
            return
        try:
            self._run.log(flatten(metrics), step=step)
        except Exception as exc:
            self._warn(f"wandb.log failed ({exc}); metrics continue in metrics.jsonl only")
            self._run = None

    def finish(self) -> None:
        """Flush and close the run (idempotent)."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish()
        except Exception as exc:
            self._warn(f"wandb finish failed ({exc}); the offline files may be incomplete")

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    @staticmethod
    def _warn(message: str) -> None:
        print(f"megalite: warning: {message}", file=sys.stderr, flush=True)

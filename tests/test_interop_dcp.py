"""megalite <-> plain torch.distributed.checkpoint (tools/convert_checkpoint.py --to dcp / --from dcp).

Checked: torch's own DCP reader (dcp.load, and format_utils.dcp_to_torch_save, no megalite code) reads the model
and the optimizer state exactly; DCP -> megalite at another layout gives back every tensor bit for bit (fp32
bytes are moved, no arithmetic), with step and extra state; a missing shard, a corrupt file and an existing
output are one line with exit code 4, and nothing already there changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megalite.checkpoint.interop.source import from_megalite
from megalite.checkpoint.sharded import find, save_sharded
from tests.test_async_save import _step, _tiny
from tools.convert_checkpoint import main as convert


def _all(src: Path) -> dict[str, torch.Tensor]:
    source = from_megalite(src)
    try:
        return {k: source.fetch(k) for k in source.shapes}
    finally:
        source.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A megalite checkpoint of a tiny Llama after two optimizer steps (Adam moments present)."""
    root = tmp_path_factory.mktemp("dcp")
    st, model, opt, ctx = _tiny()
    _step(ctx, opt, 0)
    _step(ctx, opt, 1)
    config = {"train": {"lr": 0.01}, "optimizer": {"beta1": 0.8, "beta2": 0.9}}
    extra = {"sampler": {"consumed_samples": 4}, "config": config}
    save_sharded(root / "ckpt", 2, model, opt, extra, st, keep=1)
    return find("latest", str(root / "ckpt"))  # type: ignore[return-value]


def test_plain_dcp_readers_load_model_and_optimizer(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(saved), "--output", str(out)]) == 0
    want = _all(saved)
    names = [k.split("/", 1)[1] for k in want if k.startswith("param/")]
    sd = {"model": {n: torch.empty_like(want[f"param/{n}"]) for n in names}}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)  # torch's reader, at the state dict we ask for
    assert all(torch.equal(sd["model"][n], want[f"param/{n}"]) for n in names)
    dcp_to_torch_save(str(out), str(tmp_path / "full.pt"))  # the route torchtune/others document
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    state = full["optimizer"]["state"]
    for n in names:
        assert torch.equal(state[n]["exp_avg"], want[f"exp_avg/{n}"]) and torch.equal(state[n]["exp_avg_sq"],
                                                                                      want[f"exp_avg_sq/{n}"])
        assert float(state[n]["step"]) == 2.0
    group = full["optimizer"]["param_groups"][0]
    assert group["params"] == names and group["lr"] == 0.01 and list(group["betas"]) == [0.8, 0.9]


def test_dcp_back_to_megalite_at_another_layout_is_bit_exact(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "dcp"
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(saved), "--output", str(out)]) == 0
    assert convert(["--from", "dcp", "--to", "megalite", "--input", str(out), "--output", str(tmp_path / "back"),
                    "--tp", "2", "--pp", "2", "--quiet"]) == 0
    want, got = _all(saved), _all(tmp_path / "back")
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
    back = from_megalite(tmp_path / "back")
    assert back.step == 2 and back.optimizer_step == 2.0 and back.extra["sampler"] == {"consumed_samples": 4}
    back.close()


def test_bad_dcp_inputs_are_one_line_exit_4(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "dcp"
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(saved), "--output", str(out)]) == 0
    shard = next(out.glob("*.distcp"))
    before = sorted(p.name for p in out.iterdir())
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(saved), "--output", str(out)]) == 4
    assert "already exists" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == before
    for fmt, src, text in (("megalite", saved, "lies inside the saved checkpoint"), ("dcp", out, "lies inside --input")):
        to = "dcp" if fmt == "megalite" else "torchtitan"  # an output into its own input would change it
        assert convert(["--from", fmt, "--to", to, "--input", str(src), "--output", str(src / "sub")]) == 4
        assert text in capsys.readouterr().err and not (src / "sub").exists()
    assert sorted(p.name for p in out.iterdir()) == before
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one flipped bit
    assert convert(["--from", "dcp", "--to", "megalite", "--input", str(out), "--output", str(tmp_path / "a")]) == 4
    err = capsys.readouterr().err
    assert "corrupt (sha256 mismatch" in err and len(err.strip().splitlines()) == 1
    shard.unlink()
    assert convert(["--from", "dcp", "--to", "megalite", "--input", str(out), "--output", str(tmp_path / "a")]) == 4
    err = capsys.readouterr().err
    assert f"shard file {shard.name} named in .metadata is missing" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.tmp-*"))


class _Touch:
    """Unpickles as `Path(marker).touch()`: a stand-in for any code a crafted pickle could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return Path.touch, (self.marker,)


def test_crafted_dcp_pickles_run_no_code(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """torch's reader unpickles `.metadata` with plain pickle and object entries with weights_only=False: a
    crafted DCP directory (any --from dcp / torchtitan / megatron torch_dist input) would run code. Refused,
    one line, exit 4, nothing run; and the entry megalite needs, damaged, is one line too."""
    import pickle

    out, marker = tmp_path / "dcp", tmp_path / "ran"
    assert convert(["--from", "megalite", "--to", "dcp", "--input", str(saved), "--output", str(out)]) == 0
    (out / "megalite.sha256.json").unlink()  # an attacker rewrites that too
    capsys.readouterr()
    md = (out / ".metadata").read_bytes()
    (out / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    args = ["--from", "dcp", "--to", "megalite", "--input", str(out), "--output", str(tmp_path / "a")]
    assert convert(args) == 4
    err = capsys.readouterr().err.strip()
    assert "needs pathlib.Path.touch to be unpickled" in err and len(err.splitlines()) == 1, err
    assert not marker.exists() and not (tmp_path / "a").exists()
    (out / ".metadata").write_bytes(md)
    assert convert(args + ["--quiet"]) == 0  # the real metadata passes the allow-list
    capsys.readouterr()
    for meta, text in ((_Touch(marker), "refusing to run code from it"),  # torch.save pickles it via getattr
                       ("{not json", "is not valid JSON"), (7, "is not the JSON megalite writes")):
        crafted = tmp_path / f"crafted{len(text)}"
        dcp.save({"model": {"w": torch.zeros(2)}, "megalite": meta}, checkpoint_id=str(crafted), no_dist=True)
        assert convert(["--from", "dcp", "--to", "megalite", "--input", str(crafted), "--output",
                        str(tmp_path / "b")]) == 4
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
        assert not marker.exists() and not (tmp_path / "b").exists()

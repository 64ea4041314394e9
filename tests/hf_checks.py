"""Checks the Hugging Face interop tests share (tests/test_hf_deepseek.py, test_hf_gpt_oss.py, test_hf_gemma3.py):
one training step of an imported model against transformers' (the same loss, and every weight gradient mapped to
transformers' tensors by the import's own rules), and bad config.json files refused in one line.

transformers' `labels=ids` loss shifts (predicts ids[1:] from ids[:-1]), which is megalite's (inputs, labels) cut:
causal attention, so the last position changes nothing; checked here too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from megalite.checkpoint.interop import hf
from megalite.checkpoint.interop.hf import _to_hf
from megalite.checkpoint.sharded import read_index
from megalite.errors import CheckpointError
from megalite.inference.load import load_model

# (HF name, a gradient in megalite's layout cut and transposed as transformers stores it, model info) -> as stored
Layout = Callable[[str, torch.Tensor, dict[str, Any]], torch.Tensor]


def assert_one_step(theirs: Any, ckpt: Path, ids: torch.Tensor, rules: Callable[[dict[str, Any]], list[hf.Rule]],
                    layout: Layout, atol: float) -> dict[str, torch.Tensor]:
    """transformers' model `theirs` and the import `ckpt` of it take one step on `ids` [B, S + 1]: their losses
    agree to `atol` and so does every gradient; returns transformers' gradients (those it has)."""
    info = read_index(ckpt)["model"]
    ours, _ = load_model(ckpt)
    ours.train()
    theirs.train()
    vocab = theirs.config.vocab_size
    inputs, labels = ids[:, :-1], ids[:, 1:]
    want = theirs(ids, labels=ids).loss
    with torch.no_grad():
        same = F.cross_entropy(theirs(inputs).logits.reshape(-1, vocab), labels.reshape(-1))
    assert torch.allclose(want, same, atol=1e-6)
    got = ours(inputs, labels).mean()
    assert abs(got.item() - want.item()) <= atol, (got.item(), want.item())
    want.backward()
    got.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    hf_grads = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    checked = set()
    for name, hf_names, split, transposed in rules(info):
        if name not in grads:  # a buffer (DeepSeek's router bias): no gradient either side
            continue
        g = grads[name][:vocab] if name in ("embedding.weight", "head.weight") else grads[name]
        for hf_name, pieces in hf.stacked(hf_names, _to_hf(g, split, transposed)).items():
            torch.testing.assert_close(layout(hf_name, torch.cat(pieces), info), hf_grads[hf_name], atol=atol,
                                       rtol=0, msg=hf_name)
            checked.add(hf_name)
    assert checked == set(hf_grads)
    return hf_grads


def assert_imports_refused(base: Path, cases: list[tuple[dict[str, Any], str]], tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """Each (config.json overrides, words) of `cases` applied to HF directory `base`: tools/import_hf.py exits with
    CheckpointError's code, one line naming `words`, and writes nothing."""
    from tools.import_hf import main as import_main

    capsys.readouterr()
    for i, (over, words) in enumerate(cases):
        src = tmp_path / f"bad{i}"
        src.mkdir()
        (src / "model.safetensors").symlink_to(base / "model.safetensors")
        (src / "config.json").write_text(json.dumps({**json.loads((base / "config.json").read_text()), **over}))
        out = tmp_path / f"out{i}"
        code = import_main(["--input", str(src), "--output", str(out), "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == CheckpointError.exit_code and words in err and len(err.splitlines()) == 1, (over, err)
        assert not out.exists()


def assert_exported_back(theirs: Any, ckpt: Path, out: Path, atol: Callable[[str], float] = lambda name: 0.0) -> Any:
    """tools/export_hf.py of `ckpt` (an import of `theirs`) loads into transformers as `theirs`' class and layer
    pattern with the same tensors (to `atol(name)`, 0: bit for bit); returns the loaded model."""
    import transformers

    from tools.export_hf import main as export_main

    assert export_main(["--input", str(ckpt), "--output", str(out), "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(theirs).__name__]
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(back) is type(theirs) and back.config.layer_types == theirs.config.layer_types
    mine, orig = back.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(orig)
    for name, value in orig.items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=atol(name), msg=name)
    return back


def import_with_config(base: Path, config: dict[str, Any], where: Path) -> dict[str, Any]:
    """The index.json of tools/import_hf.py's import of HF directory `base`'s weights under another config.json."""
    from tools.import_hf import main as import_main

    (where / "hf").mkdir(parents=True)
    (where / "hf" / "model.safetensors").symlink_to(base / "model.safetensors")
    (where / "hf" / "config.json").write_text(json.dumps(config))
    assert import_main(["--input", str(where / "hf"), "--output", str(where / "ckpt"), "--quiet"]) == 0
    return read_index(where / "ckpt")

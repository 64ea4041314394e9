"""Megatron-LM checkpoints in (tools/convert_checkpoint.py --from megatron), checked against megatron-core itself.

tests/megatron_writer.py builds two tiny GPTModels with megatron-core, a Llama-style one (GQA, SwiGLU, RoPE, untied
head) and a GPT-2-style one (LayerNorm with bias, learned positions, tanh GeLU, biases, tied head), runs their
forward on fixed tokens and saves each as `torch_dist` with megatron-core's `dist_checkpointing.save`, and as legacy
TP 2 x PP 2 files. The converted megalite model's logits equal megatron-core's (fp32, same function, different
kernels: atol 1e-5 on logits of size ~2; a misplaced query group, a swapped gate/up half, a dropped bias or the erf
GeLU instead of the tanh one move them by > 1e-4), at the converted layouts tp1 and tp2 x pp2: the latter loaded
into one process (its tensors bit-equal to tp1's) and run on 4 live gloo ranks, each building only its stage and
TP shards (TP partial sums reorder fp32 additions: the same 1e-5). Bad inputs are one line and exit code 4, with
nothing written. docs/checkpoints.md's three recipes run as written. megatron-core installs from the registry
without changing torch (its torch_dist writer also needs psutil); where it is absent the module is skipped."""

from __future__ import annotations

import argparse
import fractions
import json
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core psutil)")
pytest.importorskip("psutil", reason="megatron-core's torch_dist writer needs psutil (pip install psutil)")

from megalite.inference.load import load_model  # noqa: E402
from megalite.training.trainer import main as pretrain  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from tests.interop_ranks import live_logits_tp2_pp2  # noqa: E402
from tests.test_interop_dcp import _all  # noqa: E402
from tests.test_reliability import REPO, _env  # noqa: E402
from tools.convert_checkpoint import main as convert  # noqa: E402

CASES = [(m, k) for m in ("llama", "gpt2") for k in ("torch_dist", "legacy")]
LAYOUTS = {"tp1": [], "tp2pp2": ["--tp", "2", "--pp", "2"]}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("megatron")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "megatron_writer.py"), str(out), str(free_port())],
                          capture_output=True, text=True, env=_env(), cwd=str(REPO), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _logits(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    model, _ = load_model(ckpt)
    with torch.no_grad():
        return model(ids)


def _convert(src: Path, out: Path, *layout: str) -> int:
    return convert(["--from", "megatron", "--to", "megalite", "--input", str(src), "--output", str(out), "--quiet",
                    *layout])


@pytest.fixture(scope="module")
def converted(written: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], Path]:
    """Every (model, format) converted at tp1 and at tp2 x pp2."""
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for model, kind in CASES:
        for lay, flags in LAYOUTS.items():
            out[(model, kind, lay)] = root / f"{model}_{kind}_{lay}"
            assert _convert(written / model / kind, out[(model, kind, lay)], *flags) == 0
    return out


@pytest.mark.timeout(900)  # the module's first test also pays the megatron-core writer run (~30 s on 2 busy cores)
def test_converted_logits_equal_megatron_core_at_tp1_and_tp2_pp2(written: Path, converted: dict) -> None:
    for model, kind in CASES:
        ref = torch.load(written / model / "logits.pt", weights_only=True)
        for lay in LAYOUTS:
            got = _logits(converted[(model, kind, lay)], ref["ids"])
            torch.testing.assert_close(got, ref["logits"], rtol=0, atol=1e-5, msg=f"{model} {kind} {lay}")
        a, b = _all(converted[(model, kind, "tp1")]), _all(converted[(model, kind, "tp2pp2")])
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), (model, kind)


@pytest.mark.timeout(900)
def test_tp2_pp2_logits_on_four_live_ranks(written: Path, converted: dict, dist_world) -> None:
    ids = torch.load(written / "llama" / "logits.pt", weights_only=True)["ids"]  # the same tokens for both models
    paths = [str(converted[(model, kind, "tp2pp2")]) for model, kind in CASES]
    per_rank = dist_world(4).run(live_logits_tp2_pp2, paths, ids)
    got = [next(r[i] for r in per_rank if r[i] is not None) for i in range(len(CASES))]  # one rank has each
    for (model, kind), logits in zip(CASES, got):
        ref = torch.load(written / model / "logits.pt", weights_only=True)
        assert torch.equal(ref["ids"], ids)
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5, msg=f"{model} {kind} live tp2 x pp2")


def _copy(written: Path, tmp_path: Path, model: str = "llama", kind: str = "torch_dist") -> Path:
    src = tmp_path / f"in_{model}_{kind}"
    shutil.copytree(written / model / kind, src)
    return src / "iter_0000005"


def _common(it: Path, **changes: object) -> None:
    common = torch.load(it / "common.pt", weights_only=False)
    args = vars(common["args"])
    args.update(changes)
    common["args"] = argparse.Namespace(**args)
    torch.save(common, it / "common.pt")


@pytest.mark.timeout(900)
def test_bad_megatron_inputs_are_one_line_exit_4(written: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def refused(src: Path, text: str) -> None:
        before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
        assert _convert(src.parent, tmp_path / "out") == 4
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out").exists() and {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before

    it = _copy(written, tmp_path)
    _common(it, num_experts=8)
    refused(it, "mixture-of-experts layers (num_experts=8)")
    _common(it, num_experts=None, multi_latent_attention=True)
    refused(it, "multi-latent attention (MLA)")
    _common(it, multi_latent_attention=False, vision_model_type="clip")  # a LLaVA-style checkpoint's args
    refused(it, "a vision tower (clip)")
    _common(it, vision_model_type=None, qk_layernorm=True)
    refused(it, "query/key norms (qk_layernorm)")
    _common(it, qk_layernorm=False)
    meta = json.loads((it / "metadata.json").read_text())
    (it / "metadata.json").write_text(json.dumps(dict(meta, num_layers=8)))
    refused(it, "metadata.json and common.pt disagree (num_layers: metadata.json 8 vs common.pt args 4)")
    (it / "metadata.json").write_text(json.dumps(meta))
    _common(it, tokenizer_model=fractions.Fraction(1, 3))  # a class outside the allow-list
    refused(it, "needs the class fractions.Fraction")
    _common(it, tokenizer_model=None)
    # Crafted or damaged files: one line each, never a traceback, and no layer silently dropped.
    tracker = it.parent / "latest_checkpointed_iteration.txt"
    tracker.write_text("five\n")
    refused(it, "latest_checkpointed_iteration.txt holds 'five'")
    tracker.write_text("5")
    (it / "metadata.json").write_text("{broken")
    refused(it, "metadata.json is not valid JSON")
    (it / "metadata.json").write_text(json.dumps(meta))
    _common(it, num_layers="4")
    refused(it, "args.num_layers is '4', not a positive integer")
    _common(it, num_layers=2)  # fewer than the 4 stacked: would drop two layers
    refused(it, "holds 4 layers but args.num_layers is 2")
    _common(it, num_layers=4)
    shard = sorted(it.glob("*.distcp"))[-1]
    shard.unlink()
    refused(it, f"shard file {shard.name} named in .metadata is missing")
    gpt2 = _copy(written, tmp_path, "gpt2")
    _common(gpt2, bias_gelu_fusion=False)  # Megatron-LM --no-bias-gelu-fusion: torch's erf GeLU
    refused(gpt2, "the exact (erf) GeLU (bias_gelu_fusion=False, openai_gelu=False)")
    legacy = _copy(written, tmp_path, "gpt2", "legacy")
    (legacy / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    refused(legacy, "mp_rank_01_001/model_optim_rng.pt is missing (a 2 x 2 TP x PP checkpoint)")
    shallow = _copy(written, tmp_path / "shallow", "llama", "legacy")
    state = torch.load(shallow / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)
    state["args"].num_layers = 8  # the files hold 2 layers per stage
    torch.save(state, shallow / "mp_rank_00_000" / "model_optim_rng.pt")
    refused(shallow, "holds 2 layers, but args.num_layers 8 over 2 pipeline stages is 4 per stage")
    old = _copy(written, tmp_path, "llama", "legacy")
    first = old / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(first, weights_only=False)
    torch.save(dict(state, model={"language_model": {"embedding": {}}}), first)  # megatron.legacy.model's nesting
    refused(first.parent, "the layout of Megatron-LM's pre-core model (language_model.*)")


@pytest.mark.timeout(900)
def test_megatron_args_are_checked_against_the_tensors(written: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """Every declared dim against the tensor shapes, flags typed, a tied head that is not the embedding, and
    optimizer state (refused unless --weights-only): one line each, exit 4, nothing written; and a refusal is
    that one line even where megatron-core warns about its missing Transformer Engine / Apex on import."""
    def refused(src: Path, text: str, *flags: str) -> None:
        assert _convert(src.parent, tmp_path / "out", *flags) == 4
        err = capsys.readouterr().err.strip()
        assert text in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out").exists()

    cases = [(dict(num_query_groups=4), "(num_attention_heads=4, num_query_groups=4, hidden_size=32)"),
             (dict(ffn_hidden_size=32), "mlp.linear_fc1.weight (one layer of it) is [128, 32] but the checkpoint's "
                                        "args (ffn_hidden_size=32"),
             (dict(group_query_attention="false"), "args.group_query_attention is 'false', not True or False"),
             (dict(kv_channels="8"), "args.kv_channels is '8', not a positive integer"),
             (dict(padded_vocab_size=256), "args.padded_vocab_size is 256 but the embedding has 512 rows"),
             (dict(norm_epsilon="1e-5"), "args.norm_epsilon is '1e-5', not a positive number"),
             (dict(untie_embeddings_and_output_weights=False), "output_layer.weight differs from the embedding")]
    for i, (change, text) in enumerate(cases):
        it = _copy(written, tmp_path / str(i))
        _common(it, **change)
        refused(it, text)
    legacy = _copy(written, tmp_path, "llama", "legacy")
    _common_legacy = legacy / "mp_rank_01_001" / "model_optim_rng.pt"
    state = torch.load(_common_legacy, weights_only=False)
    key = next(k for k in state["model"] if k.endswith("linear_fc1.weight"))
    state["model"][key] = torch.cat([state["model"][key]] * 2)  # one TP shard of one layer twice as wide
    torch.save(state, _common_legacy)
    refused(legacy, "is [192, 32] but the checkpoint's args (ffn_hidden_size=64")
    state["model"][key] = state["model"][key][: state["model"][key].shape[0] // 2]
    state["optimizer"] = {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []}}
    torch.save(state, _common_legacy)
    refused(legacy, "holds Megatron's optimizer state")
    assert _convert(legacy.parent, tmp_path / "out", "--weights-only") == 0
    err = capsys.readouterr().err.strip()
    assert "not carried: Megatron's optimizer state (--weights-only); Megatron's opt_param_scheduler and rng_state" in \
        err and len(err.splitlines()) == 1, err
    proc = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "--from", "megatron", "--to", "megalite",
                           "--input", str(legacy.parent), "--output", str(tmp_path / "o2")], capture_output=True,
                          text=True, env={k: v for k, v in _env().items() if k != "PYTHONWARNINGS"}, cwd=str(REPO),
                          timeout=300)
    assert proc.returncode == 4 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# ------------------------------------------------------------------ docs/checkpoints.md's recipes run as written

def _recipe_commands() -> list[list[str]]:
    """Each `python ...` command of docs/checkpoints.md's "Other frameworks" section, continuation lines joined."""
    text = (REPO / "docs" / "checkpoints.md").read_text()
    section = text[text.index("## Other frameworks"):text.index("## Hugging Face export")]
    out, pending = [], ""
    for line in section.splitlines():
        pending += line.strip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.startswith("python "):
            out.append(shlex.split(pending.split("  #")[0]))
        pending = ""
    return out


@pytest.mark.timeout(900)
def test_doc_recipes_run_as_written_and_the_converted_run_resumes(written: Path, converted: dict, tmp_path: Path,
                                                                  demo_cache_dir: str, monkeypatch) -> None:
    """The placeholders the recipes name are made first: `megatron_ckpt` (megatron-core's torch_dist), `ckpt`
    (a megalite checkpoint), `outputs/checkpoint/step-1000` + `titan_args.json` (torchtitan's layout, by the
    converter, whose output tests/test_interop_torchtitan.py loads with torchtitan's own loaders)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(written / "llama" / "torch_dist", "megatron_ckpt")
    shutil.copytree(converted[("llama", "torch_dist", "tp1")], "ckpt")
    assert convert(["--from", "megalite", "--to", "torchtitan", "--input", "ckpt", "--output",
                    "outputs/checkpoint/step-1000"]) == 0
    shutil.copy("outputs/checkpoint/step-1000/megalite_model_args.json", "titan_args.json")
    commands = _recipe_commands()
    assert [c[1] for c in commands].count("tools/convert_checkpoint.py") == 5 and commands[-1][1] == "pretrain.py"
    for argv in commands[:-1]:
        assert convert(argv[2:] + ["--quiet"]) == 0, argv
        assert Path(argv[argv.index("--output") + 1]).is_dir(), argv
    run = commands[-1][2:]
    assert run[-2:] == ["--data.path", "..."]  # the user's data: the demo corpus here
    lr = 1e-3
    assert pretrain(run[:-2] + ["--data.cache_dir", demo_cache_dir, "--data.demo_max_bytes", "300000",
                                "--data.demo_vocab_size", "512", "--train.micro_batch_size", "2",
                                "--train.steps", "6", "--train.lr", str(lr), "--train.min_lr", str(lr),
                                "--train.warmup_steps", "0", "--train.eval_interval", "0",
                                "--logging.dir", "logs", "--checkpoint.dir", "run"]) == 0
    rows = [json.loads(line) for line in Path("logs/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [6] and math.isfinite(rows[0]["loss"])  # resumed at Megatron's step 5
    # Adam's first step from fresh moments moves each weight by lr * g/(|g|+eps) (at most lr, ~lr where |g| >> eps)
    # plus decoupled weight decay lr * wd * |w| (wd 0.1, the default): so the run started from the converted weights
    # (another init is ~0.1 away) and no stale moments were used (they would scale the steps arbitrarily).
    before, after = _all(Path(commands[-2][commands[-2].index("--output") + 1])), _all(Path("run/step_00000006"))
    params = [k for k in before if k.startswith("param/")]
    for k in params:  # + 2 ulps of |w| (<= 1): fp32 round-off of the update and of the difference
        ulps = 2 * torch.finfo(torch.float32).eps * before[k].abs().clamp(min=1e-3)
        assert ((after[k] - before[k]).abs() <= lr * (1 + 0.1 * before[k].abs()) + ulps).all(), k
    assert max((after[k] - before[k]).abs().max().item() for k in params) >= 0.9 * lr

"""Generation: the KV cache changes nothing (token for token), greedy equals transformers' `generate` on the
exported model, and tools/generate.py reads a checkpoint of any layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megalite.checkpoint.offline import reshard
from megalite.checkpoint.sharded import save_sharded
from megalite.data import load_tokenizer
from megalite.errors import DataError
from megalite.inference.generate import KVCache, SamplingConfig, TextStream, forward_cached, generate_ids
from megalite.model.gpt import GPT
from megalite.parallel.state import ParallelState
from tests.parallel_utils import layout, tiny_model_cfg
from tests.tokenizer_utils import train_hf_bpe
from tools.export_hf import main as export_main
from tools.generate import main as generate_main

SEQ = 40
# Cached and uncached logits are the same fp32 math in a different grouping (SDPA over a prefix vs the
# full causal SDPA, one token's matmuls vs the whole sequence's): they agree to a few fp32 ulps of the
# largest logit (|logit| reaches ~10 here, ulp ~1e-6), so the bound is relative to it. A wrong position
# (RoPE offset, learned position) or a stale cache entry gives O(0.1) differences.
LOGITS_RTOL = 1e-5


def _model(arch: str, vocab: int = 97, seed: int = 3) -> GPT:
    cfg = tiny_model_cfg(arch, vocab_size=vocab, seq_len=SEQ, num_layers=3)
    model = GPT(cfg, ParallelState(), seed=seed).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # sharpen the distribution: a random init at std 0.02 is near-uniform (ties)
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_kv_cache_equals_full_recompute(arch: str) -> None:
    model = _model(arch)
    prompt = [5, 17, 3, 42, 8]
    for sampling in (SamplingConfig(30), SamplingConfig(30, temperature=1.0, top_k=20, top_p=0.9, seed=7)):
        cached = list(generate_ids(model, prompt, sampling, use_cache=True))
        full = list(generate_ids(model, prompt, sampling, use_cache=False))
        assert cached == full and len(cached) == 30
    # The logits themselves, prefill and one-token steps, against the model's ordinary forward.
    ids = torch.tensor([prompt + cached[:20]])
    cache = KVCache(model, 1, torch.float32)
    got = torch.cat([forward_cached(model, ids[:, :5], cache), forward_cached(model, ids[:, 5:6], cache)] +
                    [forward_cached(model, ids[:, i:i + 1], cache) for i in range(6, ids.shape[1])], dim=1)
    with torch.no_grad():
        want = model(ids)[..., :97]
    assert (got - want).abs().max().item() <= LOGITS_RTOL * want.abs().max().item()
    # Generation stops at seq_len and at a stop id.
    assert len(list(generate_ids(model, prompt, SamplingConfig(1000)))) == SEQ - len(prompt)
    stop = cached[3]
    assert list(generate_ids(model, prompt, SamplingConfig(30, stop_ids=(stop,))))[-1] == stop


def test_sampling_is_seeded_and_cut() -> None:
    model = _model("llama")
    prompt = [1, 2, 3]
    a = list(generate_ids(model, prompt, SamplingConfig(20, temperature=1.5, seed=1)))
    b = list(generate_ids(model, prompt, SamplingConfig(20, temperature=1.5, seed=1)))
    c = list(generate_ids(model, prompt, SamplingConfig(20, temperature=1.5, seed=2)))
    assert a == b and a != c
    # top_k=1 and a tiny top_p both leave only the argmax: sampling becomes greedy.
    greedy = list(generate_ids(model, prompt, SamplingConfig(20)))
    assert list(generate_ids(model, prompt, SamplingConfig(20, temperature=2.0, top_k=1, seed=5))) == greedy
    assert list(generate_ids(model, prompt, SamplingConfig(20, temperature=2.0, top_p=1e-6, seed=5))) == greedy


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_equals_transformers_generate(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    model = _model(arch)
    ckpt = save_sharded(tmp_path / "ckpt", 1, model, None, {}, ParallelState(), keep=0)
    assert export_main(["--input", str(ckpt), "--output", str(tmp_path / "hf"), "--quiet"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    prompt = [5, 17, 3, 42, 8]
    ours = list(generate_ids(model, prompt, SamplingConfig(25)))
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False, pad_token_id=0,
                          eos_token_id=None)
    assert out[0, len(prompt):].tolist() == ours


def test_text_stream_holds_split_characters() -> None:
    text = "a🙂b"
    raw = text.encode("utf-8")

    def decode(ids: list[int]) -> str:  # one "token" per byte, like byte-level BPE
        return bytes(ids).decode("utf-8", errors="replace")

    stream = TextStream(decode)
    pieces = [stream.push(b) for b in raw] + [stream.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_generate_tool_any_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok_path = train_hf_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=300)
    tok = load_tokenizer(str(tok_path))
    model = _model("llama", vocab=tok.vocab_size)
    ckpt = save_sharded(tmp_path / "ckpt", 1, model, None, {}, ParallelState(), keep=0)
    sharded = reshard(ckpt, tmp_path / "tp2pp2", tp=2, pp=3, show_progress=False)  # another layout on disk
    prompt = "def main("
    ids = list(generate_ids(model, tok.encode(prompt), SamplingConfig(15, stop_ids=(tok.eod_id,))))
    want = prompt + tok.decode(ids)
    for path in (ckpt, sharded):
        assert generate_main(["--checkpoint", str(path), "--tokenizer", str(tok_path), "--prompt", prompt,
                              "--max-tokens", "15", "--device", "cpu"]) == 0
        assert capsys.readouterr().out == want + "\n"
    # A tokenizer with more ids than the model: one line, data error.
    big = train_hf_bpe(tmp_path / "big" / "tokenizer.json", vocab_size=400)
    small = save_sharded(tmp_path / "small", 1, _model("llama", vocab=64), None, {}, ParallelState(), keep=0)
    code = generate_main(["--checkpoint", str(small), "--tokenizer", str(big), "--prompt", "x", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == DataError.exit_code and "model's vocab_size is 64" in err and len(err.strip().splitlines()) == 1
    # Without --tokenizer and nothing in the checkpoint to say which: one line.
    assert generate_main(["--checkpoint", str(small), "--prompt", "x", "--device", "cpu"]) == DataError.exit_code


def test_generate_from_imported_hf_model_finds_its_tokenizer(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """export (with tokenizer) -> import: the imported checkpoint remembers its HF directory, whose
    tokenizer.json tools/generate.py uses when --tokenizer is not given."""
    pytest.importorskip("transformers")
    from tools.import_hf import main as import_main

    tok_path = train_hf_bpe(tmp_path / "tok" / "tokenizer.json", vocab_size=300)
    tok = load_tokenizer(str(tok_path))
    model = _model("gpt2", vocab=tok.vocab_size)
    ckpt = save_sharded(tmp_path / "ckpt", 1, model, None, {}, ParallelState(), keep=0)
    assert export_main(["--input", str(ckpt), "--output", str(tmp_path / "hf"), "--tokenizer", str(tok_path),
                        "--quiet"]) == 0
    assert import_main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back"), "--quiet"]) == 0
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(tmp_path / "back"), "--prompt", "import", "--max-tokens", "10",
                          "--device", "cpu"]) == 0
    ids = list(generate_ids(model, tok.encode("import"), SamplingConfig(10, stop_ids=(tok.eod_id,))))
    assert capsys.readouterr().out == "import" + tok.decode(ids) + "\n"


def _tp_generation(rank: int, arch: str) -> list[int]:
    # init_std 0.5: sharp logits, so the tp run's different fp32 summation order cannot flip an argmax.
    cfg = tiny_model_cfg(arch, vocab_size=97, seq_len=24, init_std=0.5)
    model = GPT(cfg, layout(2), seed=3).eval()
    reference = GPT(cfg, ParallelState(), seed=3).eval()  # the same weights: init is layout-invariant
    prompt = [5, 17, 3]
    got = list(generate_ids(model, prompt, SamplingConfig(12)))
    assert got == list(generate_ids(reference, prompt, SamplingConfig(12), use_cache=False)), rank
    return got


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cached_generation_tensor_parallel(dist_world, arch: str) -> None:
    """The decoder in-training samples use at tp=2: both ranks produce the single-process tokens."""
    first, second = dist_world(2).run(_tp_generation, arch)
    assert first == second and len(first) == 12

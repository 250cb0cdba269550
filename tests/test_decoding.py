"""Decoding: the eager one-token step (the filled prefix of the cache), the compiled step (the whole cache, masked) and
the uncached forward pass give the same greedy tokens on a model loaded as sample.py loads it; sampling draws from
the top-k / top-p distribution; a row's text decoded as it grows equals the whole row decoded; and on a GPU the host
never waits for the device in a decoding step, but to read its new tokens (on the meta device, and counted on the
CPU)."""

import asyncio
import shutil

import pytest
import torch
from conftest import gpt2_encoding_error, needs_gpt2_encoding  # noqa: F401 (the skipif string)
from test_chat import chat_tokenizer, random_chat_model
from test_sample import write_char_checkpoint
from test_step_sync import SYNCING
from torch.overrides import TorchFunctionMode

from model import GPT, DecodeStep, GPTConfig, sample_next
from quillgpt import compiled_step
from quillgpt.chat_session import ChatSession
from quillgpt.generate import RowText, generate_texts, load_for_sampling
from quillgpt.serve.batcher import Batcher, GenRequest
from quillgpt.tokenizer import tokenizer_from_dict

GPT2_STYLE = dict(block_size=64, n_layer=2, n_head=4, n_embd=64)  # learned positions, LayerNorm, GELU
MODERN_SWITCHES = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, n_kv_head=1, bias=False)
MODERN = dict(GPT2_STYLE, **{**MODERN_SWITCHES, "n_kv_head": 2})
real = compiled_step.aoti_step


@pytest.fixture(scope="module", params=[GPT2_STYLE, MODERN], ids=["gpt2-style", "modern-gqa"])
def loaded(request, tmp_path_factory):
    ckpt = write_char_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt_best.pt", **request.param)
    model, tokenizer, _ = load_for_sampling(ckpt, "cpu", "fp32")
    return model, tokenizer


def test_eager_decoding_gives_the_uncached_greedy_tokens_within_and_past_the_context(loaded):
    """Within block_size the cached eager path equals recomputing the whole sequence each token; past it (the cache
    refilled from the last block_size/2 tokens) sample.py's text equals model.generate's."""
    model, tokenizer = loaded
    prompt = torch.tensor([tokenizer.encode("the king ")])
    cached = model.generate(prompt, 50, temperature=0)
    assert torch.equal(cached, model.generate(prompt, 50, temperature=0, use_cache=False))
    assert len(set(cached[0, 9:].tolist())) > 3  # the text varies: a real comparison
    long = model.generate(prompt, 150, temperature=0)
    texts, _ = generate_texts(model, tokenizer, prompt[0].tolist(), 1, 150, temperature=0)
    assert texts[0] == tokenizer.decode(long[0, 9:].tolist())


@pytest.mark.slow
def test_a_compiled_step_is_kept_and_serves_every_model_of_its_shape_and_every_shorter_cache(tmp_path, monkeypatch):
    """compile=True compiles the step ahead of time and keeps it; later (as a new process) another model of the same
    shape uses it by default (compile=None) without compiling, with its own weights: each gives its eager greedy
    tokens, also when their generations take turns on the one package and when a call needs a shorter cache than
    the kept one (it takes the kept length); a chat session's reply too. Another shape gets none."""
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    model, other = (random_chat_model(block_size=128, seed=seed, **MODERN_SWITCHES) for seed in (0, 1))
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    eager = model.generate(prompt, 150, temperature=0)  # past block_size: a refill
    assert torch.equal(model.generate(prompt, 150, temperature=0, compile=True), eager)
    assert [compiled_step.package_length(p) for p in compiled_step.packages_dir().glob("*.pt2")] == [128]
    compiled_step._loaded.clear()  # as a new process: loaded from disk
    monkeypatch.setattr(compiled_step, "compile_package", lambda *a: pytest.fail("compiled again"))
    other_eager = other.generate(prompt, 150, temperature=0)
    assert not torch.equal(other_eager, eager)  # other weights: a real test of whose weights the step reads
    steps = []
    monkeypatch.setattr(compiled_step, "aoti_step", lambda *a: steps.append(a[2].length) or real(*a))
    assert torch.equal(other.generate(prompt, 150, temperature=0, compile=None), other_eager) and steps == [128] * 2
    assert torch.equal(other.generate(prompt, 10, temperature=0, compile=True), other_eager[:, :15])  # needs 64
    streams = (m.generate_stream(prompt, 20, temperature=0, compile=None) for m in (model, other))
    turns = zip(*streams)  # one token of each in turn, on the one package
    mine, theirs = (torch.cat(tokens, dim=1) for tokens in zip(*turns))
    assert torch.equal(mine, eager[:, 5:25]) and torch.equal(theirs, other_eager[:, 5:25])
    assert steps == [128] * 5
    replies = [ChatSession(other, chat_tokenizer(), compile=c).reply("What is 17 + 25?") for c in (False, None)]
    assert replies[0] == replies[1] and len(replies[0]) > 5 and steps == [128] * 6
    steps.clear()
    wider = random_chat_model(block_size=128, **{**MODERN_SWITCHES, "n_kv_head": 2})  # another shape
    wider.generate(prompt, 10, temperature=0, compile=None)
    assert not steps


def test_only_a_finished_run_of_five_minutes_or_more_keeps_the_decoding_step_by_default():
    """training.keep_decoding_step: none (auto) keeps sample.py's compiled step after a run long enough that the
    compile is a small part of it, where sample.py decodes on the CPU; true and false decide alone; an evaluation, a
    run stopped by a signal or by non-finite losses never keeps one."""
    from quillgpt.generate import KEEP_STEP_AFTER_SECONDS, keeps_decoding_step, pick_device

    cpu_here = pick_device("auto").type == "cpu"
    assert keeps_decoding_step(None, False, "finished", KEEP_STEP_AFTER_SECONDS) == cpu_here
    assert keeps_decoding_step(None, False, "early stopping: val_loss has not improved", 3600) == cpu_here
    assert not keeps_decoding_step(None, False, "finished", KEEP_STEP_AFTER_SECONDS - 1)
    assert keeps_decoding_step(True, False, "finished", 1) and not keeps_decoding_step(False, False, "finished", 3600)
    for ending in ("signal", "stopped: 10 consecutive non-finite steps; the last good checkpoint is intact"):
        assert not keeps_decoding_step(True, False, ending, 3600)
    assert not keeps_decoding_step(True, True, "finished", 3600)  # eval_only


def test_a_run_of_several_processes_keeps_no_decoding_step_and_says_why(capsys, tmp_path, monkeypatch):
    """A torchrun job's ranks ran on a share of the cores, and a kept step is compiled for the threads it will run
    on (sample.py's): rank 0 says so in one line and compiles nothing."""
    from quillgpt.generate import keep_decoding_step

    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    keep_decoding_step(tmp_path / "not-read.pt", processes=2)
    assert "decoding step not kept: the 2 processes of this run" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_a_run_that_keeps_its_decoding_step_leaves_the_one_sample_py_decodes_with(tmp_path, monkeypatch, capsys):
    """A run told to (training.keep_decoding_step) compiles the step for the model as sample.py loads it and keeps
    it: sample.py's lookup finds it for any cache up to the context, and a generation with it gives the eager greedy
    tokens. A run of that shape later finds it kept and compiles nothing; a short run (auto) keeps none; with no
    working C++ compiler the run ends as it would, with one line."""
    from test_export import tiny_run, words

    from train import train

    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    text = words("abcdefgh ")
    train(overrides=tiny_run(tmp_path, "kept", text, "short"))  # auto, a few seconds
    assert not list(tmp_path.rglob("*.pt2")) and "[compiling" not in capsys.readouterr().out
    run = train(overrides=tiny_run(tmp_path, "kept", text, "keeps", **{"training.keep_decoding_step": True}))
    printed = capsys.readouterr().out
    model, _, _ = load_for_sampling(run.checkpoint_path, "cpu", "auto")
    path = compiled_step.kept_package(model, 1, model.config.block_size, build=False)
    assert path is not None and f"{path}; sample.py, chat.py and serve.py use it]" in printed
    assert compiled_step.kept_package(model, 1, 8, build=False) == path  # a short call's cache: the kept one serves
    steps = []
    monkeypatch.setattr(compiled_step, "aoti_step", lambda *a: steps.append(a[2].length) or real(*a))
    prompt = torch.tensor([[1, 2, 3]])
    kept = model.generate(prompt, 20, temperature=0, compile=None)
    assert steps == [32] and torch.equal(kept, model.generate(prompt, 20, temperature=0, compile=False))
    monkeypatch.setattr(compiled_step, "compile_package", lambda *a: pytest.fail("compiled again"))
    train(overrides=tiny_run(tmp_path, "kept", text, "again", **{"training.keep_decoding_step": True}))
    assert "is kept already" in capsys.readouterr().out
    from torch._inductor import config

    monkeypatch.undo()
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    with config.patch({"cpp.cxx": (None, shutil.which("false") or "/bin/false")}):
        wider = tiny_run(tmp_path, "kept", text, "wider", **{"training.keep_decoding_step": True, "model.n_embd": 48})
        assert train(overrides=wider).iterations == 6
    assert "[not kept: --compile needs a working C++ compiler" in capsys.readouterr().out
    assert len(list(tmp_path.rglob("*.pt2"))) == 1


def test_the_eager_step_reads_the_filled_prefix_and_matches_the_masked_whole_cache(loaded, monkeypatch):
    """Eager, a step attends over the positions written so far with SDPA and no mask; under torch.compile over the
    whole cache with the rest masked. The logits agree at every position."""
    model, tokenizer = loaded
    prompt = torch.tensor([tokenizer.encode("the lord ")])

    def step_logits() -> list[torch.Tensor]:
        cache = model.new_cache(1, 32)
        with torch.inference_mode():
            model(prompt, cache=cache)
            out = []
            for pos in range(prompt.size(1), 32):
                out.append(model.decode_one(torch.tensor([[pos % 20]]), torch.tensor([pos]), cache))
                cache.pos += 1
        return out

    cache = model.new_cache(1, 32)
    cache.pos = 5  # the position being written: the eager span is read from the cache's count, not the device
    assert DecodeStep.at(torch.tensor([5]), cache).span == 6 and DecodeStep.at(torch.tensor([5]), cache).visible is None
    eager = step_logits()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    masked = DecodeStep.at(torch.tensor([5]), cache)
    assert masked.span == 32 and masked.visible.tolist() == [True] * 6 + [False] * 26
    for a, b in zip(eager, step_logits(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sampling_draws_the_top_k_distribution_scaled_by_the_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits, 0.5, 3, None, g) for _ in range(6000)])
    freq = torch.bincount(draws.view(-1), minlength=5).float() / draws.numel()
    expected = torch.cat([torch.softmax(logits[0, :3] / 0.5, -1), torch.zeros(2)])
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)


def test_sampling_a_batch_over_the_whole_vocabulary_draws_each_rows_distribution_and_never_a_token_of_mass_0(
    monkeypatch,
):
    """No top-k: each of 64 rows draws from its own softmax (model.draw, one uniform number per row); a token whose
    probability is 0 is never drawn, wherever it sits (first, between others, last)."""
    logits = torch.tensor(
        [[-float("inf"), 1.0, 0.0, -float("inf"), 2.0, -float("inf")], [3.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    )
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits.repeat(32, 1), 1.0, None, None, g) for _ in range(200)], dim=1)  # (64, 200)
    for row in range(2):
        freq = torch.bincount(draws[row::2].flatten(), minlength=6).float() / draws[row::2].numel()
        torch.testing.assert_close(freq, torch.softmax(logits[row], -1), atol=0.015, rtol=0)
    assert set(draws[0::2].flatten().tolist()) == {1, 2, 4}
    for u, first in ((0.0, 1), (1 - 2**-53, 4)):  # the draws at both ends: the first and last tokens of mass > 0
        monkeypatch.setattr(torch, "rand", lambda *shape, dtype, **kw: torch.full(shape, u, dtype=dtype))  # noqa: B023
        assert sample_next(logits[:1], 1.0, None, None).item() == first


def test_top_p_keeps_each_rows_own_nucleus():
    """Row 0's nucleus is its best token alone, row 1's the three near-equal ones: a batch draws each from its own."""
    logits = torch.tensor([[9.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, -5.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits, 1.0, None, 0.9, g) for _ in range(300)], dim=1)
    assert set(draws[0].tolist()) == {0}
    assert set(draws[1].tolist()) == {0, 1, 2}
    assert set(sample_next(logits, 1.0, 4, 0.9, g).view(-1).tolist()) <= {0, 1, 2}  # top-k, then top-p


@needs_gpt2_encoding
def test_a_rows_text_decoded_as_it_grows_equals_the_whole_row_decoded():
    """Characters split across byte-level tokens show as U+FFFD until complete, then as the whole row's text."""
    tokenizer = tokenizer_from_dict({"kind": "tiktoken", "name": "gpt2"})
    prompt, row = tokenizer.encode("Hello"), tokenizer.encode(" naïve 🦜🦜 café, déjà vu\n\n  x")
    text = RowText(tokenizer, prompt)
    for i, token in enumerate(row, 1):
        grown = text.add(token)
        whole = tokenizer.decode_after(prompt[-8:], row[:i])
        assert grown == whole
    assert grown == " naïve 🦜🦜 café, déjà vu\n\n  x"


def test_appending_several_tokens_to_a_filled_cache_gives_the_logits_of_one_whole_pass(loaded):
    """chat.py reads a new turn into a cache that holds the conversation so far: each new position sees the cache and
    the new positions before it, exactly as in one pass over the whole sequence."""
    model, tokenizer = loaded
    ids = torch.tensor([tokenizer.encode("the king and the queen say")])  # (1, T)
    with torch.no_grad():
        whole, _ = model(ids)
        cache = model.new_cache(1)
        first, _ = model(ids[:, :10], cache=cache)
        rest, _ = model(ids[:, 10:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, rtol=1e-5, atol=1e-5)


# ---- no host reads: what a GPU would wait on ----------------------------------------------------------


class HostReads(TorchFunctionMode):
    """Records each call that reads a tensor back to the host (on a GPU: waits for the device's queue to drain), as
    (name, the tensor's number of elements)."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNCING:
            self.reads.append((name, args[0].numel() if args and isinstance(args[0], torch.Tensor) else -1))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("switches", [GPT2_STYLE, MODERN], ids=["gpt2-style", "modern-gqa"])
def test_cached_decoding_reads_nothing_back_on_the_meta_device(switches):
    """The meta device stands in for a GPU: its tensors have no values, so any read back to the host (int(), .item(),
    .tolist()) raises there. The eager KV-cache steps run on it, greedy, top-k and top-p (sample.py's decoding)."""
    model = GPT(GPTConfig(vocab_size=40, **switches)).to("meta").eval()
    prompt = torch.zeros(2, 5, dtype=torch.long, device="meta")
    for kw in ({"temperature": 0}, {"top_k": 20}, {"top_k": 20, "top_p": 0.9}, {"top_p": 0.5}):
        tokens = list(model.generate_stream(prompt, 6, **{"temperature": 0.8, **kw}))
        assert len(tokens) == 6 and tokens[-1].shape == (2, 1) and tokens[-1].device.type == "meta"


def test_a_serving_step_reads_the_device_once_for_every_request_in_it(loaded):
    """serve.py's batcher decodes a greedy and two sampling requests together: each step makes one read (the new
    tokens, .tolist()); the furthest position is known on the host and every row samples on the device. (On the CPU
    top-p reads its nucleus's width, which costs nothing there: the meta test above covers it.)"""
    model, tokenizer = loaded
    batcher = Batcher(model, tokenizer, max_batch=4)
    loop = asyncio.new_event_loop()
    for temperature, seed in ((0.0, None), (1.0, 1), (0.7, 2)):
        batcher.submit(GenRequest(tokenizer.encode("the king "), 20, temperature=temperature, seed=seed), loop)
    batcher.admit()
    assert len(batcher.active) == 3
    mode = HostReads()
    with mode:
        for _ in range(6):
            batcher.step()
    loop.close()
    assert [name for name, _ in mode.reads] == ["tolist"] * 6


@pytest.mark.slow
@pytest.mark.xdist_group("compiled_step")
def test_a_damaged_or_unwritable_kept_step_is_never_trusted_and_two_processes_keep_one_at_once(tmp_path):
    """sample.py's kept step carries its sha256 in its name. Cut short, or a few bytes inside it overwritten (the
    kind of damage that made a step print other text with exit 0), it is named in one line, removed, and sample.py
    decodes eagerly: the eager text, exit 0. A cache that can't be written still decodes with --compile, saying in one
    line that nothing was kept. Two processes compiling the same step into an empty cache at once both succeed, and
    every file they leave is whole."""
    import os
    import subprocess
    import sys

    from conftest import REPO_ROOT

    from quillgpt.files import sha256_file

    ckpt = write_char_checkpoint(tmp_path / "ckpt_best.pt")
    cache = tmp_path / "cache"

    def sample(*flags: str, cache_dir=cache) -> subprocess.Popen:
        args = ["--ckpt", str(ckpt), "--prompt", "ab", "--max-new-tokens", "20", "--temperature", "0", *flags]
        env = {**os.environ, "QUILLGPT_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(
            [sys.executable, "sample.py", *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )

    def done(p: subprocess.Popen) -> tuple[str, str]:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
        return out.decode(), err.decode()

    eager, _ = done(sample("--no-compile"))
    both = [done(p) for p in [sample("--compile"), sample("--compile")]]  # at once, into one empty cache
    assert [out for out, _ in both] == [eager, eager]
    kept = sorted((cache / "decode").glob("*.pt2"))
    assert kept and all(sha256_file(p).startswith(p.stem.rsplit("-", 1)[1]) for p in kept)
    assert not [p for p in (cache / "decode").iterdir() if p.suffix != ".pt2"]  # no temporary left behind

    package = kept[0]
    whole = package.read_bytes()
    for damage in ("cut short", "overwritten inside"):
        for p in kept:
            p.write_bytes(whole[:1000] if damage == "cut short" else whole[:-4096] + b"\0" * 64 + whole[-4032:])
        out, err = done(sample())
        assert out == eager, damage
        assert err.count("is damaged") == len(kept) and "removed, not loaded" in err, err
        assert not list((cache / "decode").glob("*.pt2"))
        kept = [package]

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    out, err = done(sample("--compile", cache_dir=blocked / "cache"))
    assert out == eager and "nothing kept" in err and "Not a directory" in err

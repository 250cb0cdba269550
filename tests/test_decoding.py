"""Decoding through the engine (quillgpt/engine.py): every way of decoding gives the uncached forward pass's greedy
tokens (the eager step over the filled prefix, rows at their own positions over the masked span, the compiled step
over the whole row), within and past the context; a compiled step is kept, checked and shared by every model of its
shape; sampling draws from the top-k / top-p distribution with one number a row; a row's text decoded as it grows
equals the whole row decoded; and on a GPU the host reads nothing back but each step's new tokens (on the meta
device, and counted on the CPU)."""

import asyncio
import shutil

import pytest
import torch
from conftest import gpt2_encoding_error, needs_gpt2_encoding, uncached_greedy  # noqa: F401 (the skipif string)
from test_chat import chat_tokenizer, random_chat_model
from test_sample import write_char_checkpoint
from test_step_sync import SYNCING
from torch.overrides import TorchFunctionMode

from model import GPT, GPTConfig
from quillgpt import compiled_step
from quillgpt.chat_session import ChatSession
from quillgpt.engine import Draws, Engine, Row, RowText, Sampling, cache_length, generate, sample_next
from quillgpt.generate import generate_texts, load_for_sampling, plan_decoding
from quillgpt.serve.batcher import Batcher, GenRequest
from quillgpt.tokenizer import tokenizer_from_dict

GPT2_STYLE = dict(block_size=64, n_layer=2, n_head=4, n_embd=64)  # learned positions, LayerNorm, GELU
MODERN_SWITCHES = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, n_kv_head=1, bias=False)
MODERN = dict(GPT2_STYLE, **{**MODERN_SWITCHES, "n_kv_head": 2})
WINDOWED = dict(MODERN, sliding_window=8)
# nanochat's value embeddings, skips and smear
SKIPS = dict(MODERN, n_layer=3, value_embeds=True, backout=True, smear=True)
real = compiled_step.compiled_row_step


@pytest.fixture(
    scope="module", params=[GPT2_STYLE, MODERN, WINDOWED, SKIPS], ids=["gpt2-style", "modern-gqa", "window", "skips"]
)
def loaded(request, tmp_path_factory):
    ckpt = write_char_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt_best.pt", **request.param)
    model, tokenizer, _ = load_for_sampling(ckpt, "cpu", "fp32", compile=False)
    if model.config.smear:  # nanochat's start shuts it: open it, or decoding would pass without the cache's tokens
        with torch.no_grad():
            model.smear_lambda.fill_(2.0)
    return model, tokenizer


def cpu(model: GPT, compile: bool | None):
    """The model's decoding plan on the CPU in fp32, compiled as asked."""
    return plan_decoding(model, torch.device("cpu"), "fp32", compile)[1]


def test_eager_decoding_gives_the_uncached_greedy_tokens_within_and_past_the_context(loaded):
    """Within block_size the cached tokens are the uncached ones; past it (the cache full, each row read again from
    its last block_size/2 tokens) sample.py's text equals the engine's generate."""
    model, tokenizer = loaded
    prompt = torch.tensor([tokenizer.encode("the king ")])
    cached = generate(model, prompt, 50, temperature=0)
    assert torch.equal(cached, uncached_greedy(model, prompt, 50))
    assert len(set(cached[0, 9:].tolist())) > 3  # the text varies: a real comparison
    long = generate(model, prompt, 150, temperature=0)
    texts, _ = generate_texts(model, tokenizer, prompt[0].tolist(), 1, 150, temperature=0)
    assert texts[0] == tokenizer.decode(long[0, 9:].tolist())


def test_rows_at_their_own_positions_give_each_rows_uncached_tokens(loaded):
    """Rows of prompts of different lengths decode together (each over the span up to the furthest, masked per row),
    rows that end leave and the rest move into their places: every row's greedy tokens are its own, alone."""
    model, tokenizer = loaded
    prompts = [tokenizer.encode(t) for t in ("the king ", "a", "the queen and the lord ", "love ")]
    rows = [Row(p, max_new=n) for p, n in zip(prompts, (30, 5, 12, 40))]
    engine = Engine(model, capacity=4, length=64)
    engine.add(rows)
    while engine.rows:
        engine.step()
    for row in rows:
        alone = uncached_greedy(model, torch.tensor([row.prompt]), row.max_new)[0, len(row.prompt) :]
        assert row.new == alone.tolist() and row.finish == "length"


def test_a_prompt_read_into_a_cache_that_holds_a_conversation_gives_one_whole_pass(loaded):
    """chat.py reads a new turn into a cache that holds the conversation so far (Engine.extend): each new position
    sees the cache and the new positions before it, exactly as in one pass over the whole sequence."""
    model, tokenizer = loaded
    ids = tokenizer.encode("the king and the queen say")
    with torch.no_grad():
        whole, _ = model(torch.tensor([ids]))
    engine = Engine(model, length=64)
    row = Row(ids[:10], max_new=1)
    engine.extend(row, ids[:10], 0)
    first = engine.logits
    engine.extend(row, ids[10:], 10)
    torch.testing.assert_close(first, whole[:, 9], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(engine.logits, whole[:, -1], rtol=1e-5, atol=1e-5)


def test_the_compiled_row_view_masks_what_is_unwritten_and_gives_the_eager_logits(loaded):
    """The compiled step's cache view (GraphCache: the whole row, the unwritten part masked, a position tensor) gives
    the eager step's logits at every position, in eager PyTorch too."""
    from quillgpt.engine import GraphCache

    model, tokenizer = loaded
    prompt = tokenizer.encode("the lord ")
    eager, masked = Engine(model, length=32), Engine(model, length=32)
    for engine in (eager, masked):
        engine.add([Row(prompt, max_new=20)])
    with torch.inference_mode():
        for pos in range(len(prompt), 32):
            token = torch.tensor([[pos % 20]])
            eager.feed([pos % 20])
            c = masked.cache
            view = GraphCache([b[:1] for b in c.k], [b[:1] for b in c.v], torch.tensor([pos]), c.ids[:1])
            logits, _ = model(token, cache=view)
            masked.cache.positions[0] += 1
            torch.testing.assert_close(logits[:, -1], eager.logits, rtol=1e-5, atol=1e-5)


def test_decoding_allocates_one_cache_per_length_bucket():
    assert [cache_length(n, 1024) for n in (1, 64, 65, 300, 600, 5000)] == [64, 64, 128, 512, 1024, 1024]
    assert cache_length(100, 96) == 96


def test_a_prompt_longer_than_the_context_is_cropped_and_decoding_runs_past_it():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32)).eval()
    out = generate(model, torch.randint(0, 50, (1, 40)), 50, temperature=1.0, top_k=10)
    assert out.shape == (1, 32 + 50) and out.max() < 50


def test_each_token_after_the_prompt_runs_the_model_on_one_new_position():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50, n_layer=2, n_head=2, n_embd=32)).eval()
    seen = []
    handle = model.transformer.wte.register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    generate(model, torch.randint(0, 50, (1, 8)), 10, temperature=0)
    handle.remove()
    assert seen == [(1, 8)] + [(1, 1)] * 9


def test_a_seed_repeats_the_samples_and_a_rows_draws_do_not_depend_on_when_others_end():
    """Rows drawing from one generator take one number each per step, ended rows too: a seed gives the same
    samples, and a row that ends early changes nothing for the others."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50, n_layer=2, n_head=2, n_embd=32)).eval()
    prompt = torch.randint(0, 50, (3, 4))
    a = generate(model, prompt, 15, temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = generate(model, prompt, 15, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    draws = Draws(torch.Generator().manual_seed(3), 3)
    rows = [Row(prompt[i].tolist(), Sampling(1.0), 15 if i != 1 else 4, draws=draws, draw_index=i) for i in range(3)]
    engine = Engine(model, capacity=3)
    engine.add(rows)
    while engine.rows:
        engine.step()
    assert [r.ids for r in rows] == [a[0].tolist(), a[1, :8].tolist(), a[2].tolist()]


@pytest.mark.slow
def test_a_compiled_step_is_kept_and_serves_every_model_of_its_shape_and_every_shorter_cache(tmp_path, monkeypatch):
    """A plan with compile=True compiles the step ahead of time and keeps it; later (as a new process) another model
    of the same shape uses it by default (compile=None) without compiling, with its own weights: each gives its eager
    greedy tokens, also when their generations take turns on the one package and when a call needs a shorter cache
    than the kept one (it takes the kept length); a chat session's reply too. Another shape gets none."""
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    model, other = (random_chat_model(block_size=128, seed=seed, **MODERN_SWITCHES) for seed in (0, 1))
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    eager = generate(model, prompt, 150, temperature=0, plan=cpu(model, False))  # past block_size: a refill
    assert torch.equal(generate(model, prompt, 150, temperature=0, plan=cpu(model, True)), eager)
    assert [compiled_step.package_length(p) for p in compiled_step.packages_dir().glob("*.pt2")] == [128]
    compiled_step._loaded.clear()  # as a new process: loaded from disk
    monkeypatch.setattr(compiled_step, "compile_package", lambda *a: pytest.fail("compiled again"))
    other_plan = cpu(other, None)
    assert other_plan.step == "compiled" and "(128 positions)" in other_plan.step_why
    other_eager = generate(other, prompt, 150, temperature=0)
    assert not torch.equal(other_eager, eager)  # other weights: a real test of whose weights the step reads
    steps = []
    monkeypatch.setattr(compiled_step, "compiled_row_step", lambda *a: steps.append(a[2].length) or real(*a))
    assert torch.equal(generate(other, prompt, 150, temperature=0, plan=other_plan), other_eager) and steps == [128]
    assert torch.equal(generate(other, prompt, 10, temperature=0, plan=other_plan), other_eager[:, :15])  # needs 64
    model_plan = cpu(model, None)
    a, b = (Engine(m, p, length=64) for m, p in ((model, model_plan), (other, other_plan)))  # turns on one package
    rows = [Row(prompt[0].tolist(), max_new=20) for _ in range(2)]
    a.add(rows[:1])
    b.add(rows[1:])
    while a.rows or b.rows:
        for engine in (a, b):
            if engine.rows:
                engine.step()
    assert rows[0].ids == eager[0, :25].tolist() and rows[1].ids == other_eager[0, :25].tolist()
    assert steps == [128] * 4
    replies = [ChatSession(other, chat_tokenizer(), plan=p).reply("What is 17 + 25?") for p in (None, other_plan)]
    assert replies[0] == replies[1] and len(replies[0]) > 5 and steps == [128] * 5
    wider = random_chat_model(block_size=128, **{**MODERN_SWITCHES, "n_kv_head": 2})  # another shape
    assert cpu(wider, None).step == "eager"


@pytest.mark.slow
def test_a_compiled_step_of_a_model_with_the_switches_gives_its_eager_tokens(tmp_path, monkeypatch):
    """Value embeddings, the skips and smear (which reads the cache's tokens: the package binds them too), compiled
    ahead of time: greedy tokens equal the eager ones, past block_size (a refill) included."""
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path / "cache"))
    switches = {k: v for k, v in SKIPS.items() if k not in GPT2_STYLE}  # n_layer 3 among them
    model = random_chat_model(block_size=64, **switches)
    with torch.no_grad():
        model.smear_lambda.fill_(2.0)  # open: nanochat's start shuts it
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    eager = generate(model, prompt, 80, temperature=0, plan=cpu(model, False))
    plan = cpu(model, True)
    assert plan.step == "compiled"
    assert torch.equal(generate(model, prompt, 80, temperature=0, plan=plan), eager)


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
    model, _, plan = load_for_sampling(run.checkpoint_path, "cpu", "auto")
    path = compiled_step.kept_package(model, 1, model.config.block_size, build=False)
    assert path is not None and f"{path}; sample.py, chat.py and serve.py use it]" in printed
    assert compiled_step.kept_package(model, 1, 8, build=False) == path  # a short call's cache: the kept one serves
    steps = []
    monkeypatch.setattr(compiled_step, "compiled_row_step", lambda *a: steps.append(a[2].length) or real(*a))
    prompt = torch.tensor([[1, 2, 3]])
    assert plan.step == "compiled" and str(path) in plan.step_why
    kept = generate(model, prompt, 20, temperature=0, plan=plan)
    assert steps == [32] and torch.equal(kept, generate(model, prompt, 20, temperature=0))
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


def numbers(rows: int, generator: torch.Generator) -> torch.Tensor:
    """A step's uniform numbers for `rows` rows, as engine.Draws gives them."""
    return torch.rand(rows, 1, generator=generator, dtype=torch.float64)


def test_sampling_draws_the_top_k_distribution_scaled_by_the_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits, 0.5, 3, None, numbers(1, g)) for _ in range(6000)])
    freq = torch.bincount(draws.view(-1), minlength=5).float() / draws.numel()
    expected = torch.cat([torch.softmax(logits[0, :3] / 0.5, -1), torch.zeros(2)])
    torch.testing.assert_close(freq, expected, atol=0.02, rtol=0)


def test_sampling_a_batch_over_the_whole_vocabulary_draws_each_rows_distribution_and_never_a_token_of_mass_0():
    """No top-k: each of 64 rows draws from its own softmax (engine.draw, one uniform number per row); a token whose
    probability is 0 is never drawn, wherever it sits (first, between others, last)."""
    logits = torch.tensor(
        [[-float("inf"), 1.0, 0.0, -float("inf"), 2.0, -float("inf")], [3.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    )
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits.repeat(32, 1), 1.0, None, None, numbers(64, g)) for _ in range(200)], dim=1)
    for row in range(2):
        freq = torch.bincount(draws[row::2].flatten(), minlength=6).float() / draws[row::2].numel()
        torch.testing.assert_close(freq, torch.softmax(logits[row], -1), atol=0.015, rtol=0)
    assert set(draws[0::2].flatten().tolist()) == {1, 2, 4}
    for u, first in ((0.0, 1), (1 - 2**-53, 4)):  # the draws at both ends: the first and last tokens of mass > 0
        assert sample_next(logits[:1], 1.0, None, None, torch.full((1, 1), u, dtype=torch.float64)).item() == first


def test_top_p_keeps_each_rows_own_nucleus():
    """Row 0's nucleus is its best token alone, row 1's the three near-equal ones: a batch draws each from its own."""
    logits = torch.tensor([[9.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, -5.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits, 1.0, None, 0.9, numbers(2, g)) for _ in range(300)], dim=1)
    assert set(draws[0].tolist()) == {0}
    assert set(draws[1].tolist()) == {0, 1, 2}
    assert set(sample_next(logits, 1.0, 4, 0.9, numbers(2, g)).view(-1).tolist()) <= {0, 1, 2}  # top-k, then top-p


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


@pytest.mark.parametrize("switches", [GPT2_STYLE, MODERN, SKIPS], ids=["gpt2-style", "modern-gqa", "skips"])
def test_a_decoding_step_reads_nothing_back_on_the_meta_device(switches):
    """The meta device stands in for a GPU: its tensors have no values, so any read back to the host (int(), .item(),
    .tolist()) raises there. A prompt's pass and the model's steps (rows at one position, rows at their own) run
    on it, and so does the sampling of greedy, top-k and top-p rows: the one read a step makes is the new tokens."""
    model = GPT(GPTConfig(vocab_size=40, **switches)).to("meta").eval()
    engine = Engine(model, capacity=2, length=32)
    engine.add([Row([1, 2, 3, 4, 5], max_new=8), Row([1, 2], max_new=8)])
    for _ in range(3):
        engine.feed([1, 2])  # rows at positions of their own
    logits = engine.logits
    assert logits.shape == (2, 40) and logits.device.type == "meta"
    numbers = torch.rand(2, 1, device="meta", dtype=torch.float64)
    for k, p in ((None, None), (20, None), (20, 0.9), (None, 0.5)):
        assert sample_next(logits, 0.8, k, p, numbers).shape == (2, 1)


def test_each_engine_step_reads_the_device_once(loaded):
    """sample.py's rows, greedy and sampled: a step makes one read, the new tokens (.tolist()); positions are kept
    on the host."""
    model, tokenizer = loaded
    for sampling in (Sampling(0.0), Sampling(0.9, 20)):
        engine = Engine(model, capacity=2, length=64)
        draws = Draws(torch.Generator().manual_seed(0), 2)
        engine.add([Row(tokenizer.encode("the "), sampling, 10, draws=draws, draw_index=i) for i in range(2)])
        mode = HostReads()
        with mode:
            for _ in range(5):
                engine.step()
        assert [name for name, _ in mode.reads] == ["tolist"] * 5


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
    assert len(batcher.engine.rows) == 3
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

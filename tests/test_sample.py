"""sample.py: determinism, stop sequences, batching, streaming, the prompt loop and prompt errors."""

import io
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, chatml_without_tool

import sample
from model import GPT, GPTConfig
from quillgpt.checkpoint import save_checkpoint
from quillgpt.engine import showable_length
from quillgpt.errors import UserError
from quillgpt.generate import generate_texts, load_for_sampling, pick_device, unescape
from quillgpt.tokenizer import CharTokenizer

CHARS = list("\n abcdefghijklmnopqrstuvwxyz.,:")


def write_char_checkpoint(path: Path, seed: int = 0, tokenizer=None, **model_args) -> Path:
    """A real quillgpt checkpoint of a tiny random char model (weights scaled up so greedy text varies), over CHARS
    or the given tokenizer."""
    tokenizer = tokenizer or CharTokenizer(CHARS)
    torch.manual_seed(seed)
    shape = dict(block_size=32, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32)
    config = GPTConfig(**{**shape, **model_args})
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0 if p.dim() > 1 else 1.0)
    save_checkpoint(
        path, {"model": model.state_dict(), "model_args": config.to_dict(), "tokenizer": tokenizer.to_dict()}
    )
    return path


def run_sample(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "sample.py", *args], cwd=REPO_ROOT, input=input, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_char_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt_best.pt")


@pytest.fixture(scope="module")
def loaded(ckpt):
    model, tokenizer, _ = load_for_sampling(ckpt, "cpu")
    return model, tokenizer


def greedy(loaded, prompt: str, n: int = 40, **kw) -> str:
    model, tokenizer = loaded
    texts, _ = generate_texts(model, tokenizer, tokenizer.encode(prompt), 1, n, temperature=0, **kw)
    return texts[0]


def test_bf16_sampling_casts_the_weights_and_decodes(ckpt):
    model, tokenizer, _ = load_for_sampling(ckpt, "cpu", "bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    text = greedy((model, tokenizer), "the ", 30)
    assert len(text) > 0 and set(text) <= set(CHARS)


def test_int8_sampling_quantizes_every_linear_and_stays_close_to_fp32(ckpt):
    model, tokenizer, _ = load_for_sampling(ckpt, "cpu", "int8")
    reference, _, _ = load_for_sampling(ckpt, "cpu", "fp32")
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.lm_head.weight.dtype == torch.int8 and model.transformer.h[0].mlp.c_fc.weight.dtype == torch.int8
    x = torch.tensor([tokenizer.encode("the quick brown fox")])
    with torch.no_grad():
        ours, theirs = model(x)[0].float(), reference(x)[0]
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.995
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9
    assert set(greedy((model, tokenizer), "the ", 30)) <= set(CHARS)
    result = run_sample("--ckpt", str(ckpt), "--dtype", "int8", "--device", "cuda")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


def test_seed_makes_a_session_deterministic(ckpt):
    args = [
        "--ckpt",
        str(ckpt),
        "--interactive",
        "--num-samples",
        "2",
        "--max-new-tokens",
        "30",
        "--temperature",
        "1.0",
        "--seed",
        "7",
    ]
    first, second = run_sample(*args, input="the\nthe\n"), run_sample(*args, input="the\nthe\n")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    samples = first.stdout.split("---------------\n")
    assert len(samples) == 5 and samples[-1] == ""
    assert len(set(samples[:4])) == 4  # the seed fixes the session, not each prompt


def test_different_seeds_differ(loaded):
    model, tokenizer = loaded
    ids = tokenizer.encode("the")
    a, _ = generate_texts(model, tokenizer, ids, 2, 60, temperature=1.0, top_k=None, seed=1)
    b, _ = generate_texts(model, tokenizer, ids, 2, 60, temperature=1.0, top_k=None, seed=2)
    assert a != b
    assert a[0] != a[1]  # the rows of a batch are independent samples


def test_a_stop_sequence_spanning_tokens_ends_the_text_before_it(loaded):
    full = greedy(loaded, "a")
    stop = full[10:13]  # three characters: three tokens of the char tokenizer
    stopped = greedy(loaded, "a", stop=[stop])
    assert stop not in stopped
    assert len(stopped) < len(full)
    assert stopped == full[: full.index(stop)]


def test_streaming_never_shows_the_stop_sequence(loaded):
    model, tokenizer = loaded
    full = greedy(loaded, "a")
    stop = full[10:13]
    out = io.StringIO()
    texts, _ = generate_texts(model, tokenizer, tokenizer.encode("a"), 1, 40, temperature=0, stop=[stop], stream=out)
    assert out.getvalue() == texts[0] == full[: full.index(stop)]
    out = io.StringIO()
    texts, _ = generate_texts(model, tokenizer, tokenizer.encode("a"), 1, 40, temperature=0, stream=out)
    assert out.getvalue() == texts[0] == full


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_cli_stop_ends_the_printed_text_before_the_stop_streamed_or_not(ckpt, loaded, capsys, stream):
    full = greedy(loaded, "a", 60)
    stop = full[20:22]
    sample.main(
        [
            "--ckpt",
            str(ckpt),
            "--prompt",
            "a",
            "--max-new-tokens",
            "60",
            "--temperature",
            "0",
            "--stop",
            "never-produced",
            "--stop",
            stop,
            stream,
        ]
    )
    assert capsys.readouterr().out == "a" + full[: full.index(stop)] + "\n"


def test_batch_equals_one_at_a_time_under_greedy(loaded):
    model, tokenizer = loaded
    ids = tokenizer.encode("to be")
    batch, n_tokens = generate_texts(model, tokenizer, ids, 3, 30, temperature=0)
    singles = [generate_texts(model, tokenizer, ids, 1, 30, temperature=0)[0][0] for _ in range(3)]
    assert batch == singles
    assert n_tokens == 3 * 30


def test_interactive_reads_prompts_until_eof(ckpt, loaded):
    result = run_sample(
        "--ckpt",
        str(ckpt),
        "--interactive",
        "--temperature",
        "0",
        "--max-new-tokens",
        "20",
        input="abc\nzzz\xe9\nxyz\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"abc{greedy(loaded, 'abc', 20)}\nxyz{greedy(loaded, 'xyz', 20)}\n"
    # the prompt with an unknown character is reported on one line and the loop goes on
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith("error: prompt: character 'é'") and "not in" in error


def test_the_device_defaults_to_auto_and_sample_py_says_which_it_picked(ckpt):
    """auto is cuda where there is one, else mps, else cpu (this machine's); the line on stderr names the device and
    the precision; a device the machine lacks, or no device at all, is one line and exit 2."""
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert pick_device("auto").type == expected and pick_device("cpu") == torch.device("cpu")
    result = run_sample("--ckpt", str(ckpt), "--prompt", "the", "--max-new-tokens", "3", "--dtype", "fp32")
    assert result.returncode == 0 and result.stderr == f"[sampling {ckpt}, fp32 on {expected}]\n", result.stderr
    for device in ["tpu"] + ([] if torch.cuda.is_available() else ["cuda:0"]):
        with pytest.raises(UserError, match=f"^--device '?{device}'? ") as e:  # run_main: one line, exit 2
            sample.main(["--ckpt", str(ckpt), "--device", device])
        assert "\n" not in str(e.value)


def test_unknown_prompt_character_is_a_one_line_user_error(ckpt):
    with pytest.raises(UserError) as e:
        sample.main(["--ckpt", str(ckpt), "--prompt", "Ωmega"])
    assert len(str(e.value).splitlines()) == 1
    assert "'Ω'" in str(e.value) and "vocabulary" in str(e.value)


def test_long_prompt_is_cropped_with_a_notice(ckpt, capsys):
    sample.main(
        ["--ckpt", str(ckpt), "--prompt", "abcdefghij" * 5, "--max-new-tokens", "5", "--temperature", "0", "--verbose"]
    )
    captured = capsys.readouterr()
    assert "prompt is 50 tokens, longer than block_size 32: keeping the last 32" in captured.err
    assert "tokens/s" in captured.err
    assert captured.out.startswith("abcdefghij" * 5)


def test_generation_continues_past_block_size(loaded):
    assert len(greedy(loaded, "a", 70)) == 70  # past block_size 32: the KV cache is refilled


def test_run_directory_samples_its_best_checkpoint(tmp_path, capsys):
    write_char_checkpoint(tmp_path / "ckpt_best.pt", seed=1)
    write_char_checkpoint(tmp_path / "ckpt_last.pt", seed=2)
    (tmp_path / "latest").write_text("ckpt_last.pt\n")
    outputs = []
    for source in (tmp_path, tmp_path / "ckpt_best.pt", tmp_path / "ckpt_last.pt"):
        sample.main(["--ckpt", str(source), "--prompt", "a", "--max-new-tokens", "40", "--temperature", "0"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] != outputs[2]


def test_missing_checkpoint_is_a_one_line_user_error(tmp_path):
    with pytest.raises(UserError, match="^checkpoint not found: .*nope.pt$"):
        sample.main(["--ckpt", str(tmp_path / "nope.pt")])


def test_showable_length_holds_back_partial_stops_and_characters():
    assert showable_length("hello wor", ["world"]) == len("hello ")
    assert showable_length("hello", ["\n\n"]) == 5
    assert showable_length("hello\n", ["\n\n"]) == 5
    assert showable_length("ab\ufffd", []) == 2


def test_unescape_decodes_backslash_escapes_and_keeps_unknown_ones():
    assert unescape(r"a\nb\tc\\n") == "a\nb\tc\\n"
    assert unescape("é\\n") == "é\n"
    assert unescape(r"\q") == r"\q"


# A C++ compiler that refuses some vector instructions and logs each call: "probe" where it builds one of inductor's
# test programs (a vector ISA's check), "build" otherwise, "refused" where it fails the call.
REFUSING_COMPILER = """#!/bin/sh
kind=build
for arg in "$@"; do
  case "$arg" in *.cpp) grep -q __avx_chk_kernel "$arg" 2>/dev/null && kind=probe;; esac
done
for arg in "$@"; do
  case "$arg" in {refused}) echo "$kind refused" >> {log}; echo "refused: $arg" >&2; exit 1;; esac
done
echo "$kind" >> {log}
exec {compiler} "$@"
"""


@pytest.fixture
def refusing_compiler(tmp_path) -> tuple[Path, Path]:
    """(the compiler, its log): g++ refusing the widest vector ISA of this x86 CPU (AVX-512 and AMX, else AVX2)."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None or not Path("/proc/cpuinfo").is_file():
        pytest.skip("refuses an x86 Linux CPU's vector instructions through g++")
    widest = "-mavx512*|-mamx*" if re.search(r"\bavx512f\b", Path("/proc/cpuinfo").read_text()) else "-mavx2"
    log, cxx = tmp_path / "compiler.log", tmp_path / "cxx"
    cxx.write_text(REFUSING_COMPILER.format(refused=widest, log=log, compiler=compiler))
    cxx.chmod(0o755)
    return cxx, log


def test_inductors_isa_probes_are_skipped_only_where_the_compiler_takes_every_isa_of_the_cpu(refusing_compiler):
    from torch._inductor import config

    from quillgpt.compiled_step import compiler_takes_the_cpus_isas

    assert compiler_takes_the_cpus_isas()  # g++ takes them all
    with config.patch({"cpp.cxx": (None, str(refusing_compiler[0]))}):
        assert not compiler_takes_the_cpus_isas()
    assert refusing_compiler[1].read_text().splitlines()[-1] == "build refused"  # the check itself, refused


@pytest.mark.parametrize(
    "script",
    ["sample.py", pytest.param("chat.py", marks=pytest.mark.slow), pytest.param("serve.py", marks=pytest.mark.slow)],
)
def test_compile_without_a_working_cpp_compiler_is_one_line_and_exit_2(tmp_path, script):
    """--compile on a machine whose C++ compiler doesn't run ($CXX a program that fails): one line naming the way
    on, exit 2, before any export (chat.py's before the first message), and nothing kept."""
    if script == "serve.py":
        pytest.importorskip("fastapi")
    chat = chatml_without_tool(CharTokenizer(CHARS, eot=True)) if script == "chat.py" else None
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt", tokenizer=chat)
    env = {**os.environ, "CXX": shutil.which("false") or "/bin/false", "QUILLGPT_CACHE": str(tmp_path / "cache")}
    args = [sys.executable, script, "--ckpt", str(ckpt), "--compile"]
    extra = {"sample.py": ["--prompt", "the ", "--max-new-tokens", "4"], "serve.py": ["--port", "0"], "chat.py": []}
    run = subprocess.run(
        args + extra[script], cwd=REPO_ROOT, env=env, input="hello\n", capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith("error: --compile needs a working C++ compiler")
    assert "Traceback" not in run.stderr and not list(tmp_path.rglob("*.pt2"))


@pytest.mark.slow
def test_a_compiler_refusing_the_cpus_vector_isa_still_gets_a_kept_step_through_inductors_probes(
    tmp_path, refusing_compiler
):
    """sample.py --compile skips inductor's probes (a test program built and loaded per vector ISA) only where the C++
    compiler takes every ISA of the CPU; where it refuses one, the probes find what it builds (or none: scalar
    code), and the kept step gives the eager text."""
    cxx, log = refusing_compiler
    ckpt = write_char_checkpoint(tmp_path / "ckpt.pt")
    env = {
        **os.environ,
        "CXX": str(cxx),
        "QUILLGPT_CACHE": str(tmp_path / "cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    args = [sys.executable, "sample.py", "--ckpt", str(ckpt), "--prompt", "the ", "--temperature", "0"]
    args += ["--max-new-tokens", "24", "--no-stream"]
    runs = [
        subprocess.run([*args, flag], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
        for flag in ("--compile", "--no-compile")
    ]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and len(set(runs[1].stdout)) > 5
    assert len(list((tmp_path / "cache" / "decode").glob("*.pt2"))) == 1
    calls = log.read_text().splitlines()
    assert calls[calls.index("build refused") :].count("probe refused") >= 1 and calls[-1] == "build"


EDGE_ARGUMENTS = [
    ("--seed", "1180591620717411303424"),
    ("--seed", "-1180591620717411303424"),
    ("--temperature", "nan"),
    ("--temperature", "inf"),
    ("--temperature", "-0.5"),
    ("--top-p", "nan"),
    ("--top-p", "0"),
    ("--top-k", "-3"),
    ("--num-samples", "100000000000000000000"),
    ("--num-samples", "0"),
    ("--max-new-tokens", "-1"),
]


@pytest.mark.parametrize("flag, value", EDGE_ARGUMENTS)
def test_a_number_at_its_edge_is_one_line_and_exit_2_before_anything_loads(flag, value, capsys):
    """sample.py's and chat.py's numbers, huge, negative, NaN or infinite: argparse's one usage line naming the flag,
    exit 2, and no model read (the checkpoint named does not exist)."""
    import chat
    import sample

    for script in (sample, chat):
        if script is chat and flag in ("--num-samples", "--max-new-tokens"):
            continue
        with pytest.raises(SystemExit) as e:
            script.parse_args(["--ckpt", "/nonexistent", flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f": error: {flag} " in err.strip().splitlines()[-1], err


def test_a_seed_past_64_bits_exits_2_in_one_line(ckpt):
    result = run_sample("--ckpt", str(ckpt), "--seed", str(2**70))
    assert result.returncode == 2 and result.stderr.strip().endswith(f"not {2**70}"), result.stderr

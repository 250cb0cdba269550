"""chat.py and quillgpt.chat_session: a conversation kept in the KV cache reads only each turn's new ids and gives the
tokens a re-encoding of the whole conversation gives, replies stop at the end-of-turn token, the oldest turns go
when the context is outgrown, and the command line (streamed replies, /reset, /system, /quit, --prompt, a base
model refused)."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, chatml_without_tool

from model import GPT, GPTConfig
from quillgpt import compiled_step
from quillgpt.chat_session import ChatSession
from quillgpt.chat_template import chat_format, with_chat_tokens
from quillgpt.checkpoint import save_checkpoint
from quillgpt.errors import UserError
from quillgpt.generate import load_for_sampling, plan_decoding
from quillgpt.tokenizer import CharTokenizer

CHARS = list("\n !'+,-.0123456789:=?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
TURNS = ["What is 17 + 25?", "Spell 'night' backwards.", "How many r's are in 'strawberry'?", "Hi!"]


def chat_tokenizer(chars: list[str] = CHARS):
    return chatml_without_tool(CharTokenizer(chars, eot=True))


def random_chat_model(block_size: int = 256, seed: int = 0, vocab_size: int | None = None, **switches) -> GPT:
    """A tiny random model over the chat tokenizer's ids (weights scaled up so that greedy text varies)."""
    torch.manual_seed(seed)
    config = GPTConfig(
        block_size=block_size,
        vocab_size=vocab_size or chat_tokenizer().vocab_size,
        n_layer=2,
        n_head=2,
        n_embd=32,
        tie_embeddings=False,
        **switches,
    )
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0 if p.dim() > 1 else 1.0)
    return model.eval()


def stopping_model(after: int, block_size: int = 256, seed: int = 0, **switches) -> tuple[GPT, int]:
    """(model, n): a random model whose greedy reply to TURNS[0] is n >= `after` tokens and then <|im_end|>. The
    output layer's rows of <|im_end|> and of the first token the reply would have repeated nowhere before swap
    places, so it ends there: the model reads its input as before."""
    model, tok = random_chat_model(block_size, seed, **switches), chat_tokenizer()
    prompt = chat_format(tok).prompt_ids([{"role": "user", "content": TURNS[0]}])
    reply = greedy_reencoding(model, prompt, after + 20, stop=set())
    n = next(i for i in range(after, len(reply)) if reply[i] not in reply[:i])
    end = tok.special_tokens["<|im_end|>"]
    with torch.no_grad():
        w = model.lm_head.weight
        w[[reply[n], end]] = w[[end, reply[n]]]
    return model, n


def greedy_reencoding(model: GPT, prompt: list[int], budget: int, stop: set[int]) -> list[int]:
    """The reference: each token from a forward pass over the whole sequence, no cache (its stop id included)."""
    ids: list[int] = []
    with torch.no_grad():
        for _ in range(budget):
            logits, _ = model(torch.tensor([prompt + ids]))
            ids.append(int(logits[0, -1].argmax()))
            if ids[-1] in stop:
                break
    return ids


def save_chat_checkpoint(path: Path, model: GPT, tokenizer=None) -> Path:
    tokenizer = tokenizer or chat_tokenizer()
    save_checkpoint(
        path, {"model": model.state_dict(), "model_args": model.config.to_dict(), "tokenizer": tokenizer.to_dict()}
    )
    return path


def run_chat(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "chat.py", *args], cwd=REPO_ROOT, input=input, capture_output=True, text=True, timeout=120
    )


def test_each_turn_reads_only_its_new_ids_and_equals_reencoding_the_whole_conversation():
    model, tok = random_chat_model(), chat_tokenizer()
    fmt = chat_format(tok)
    session = ChatSession(model, tok, system="You answer briefly.", max_new_tokens=12)
    for text in TURNS[:3]:
        before, encoded = list(session.ids), session.encoded
        prompt = fmt.prompt_ids(session.messages + [{"role": "user", "content": text}])
        reply = session.reply(text)
        generated = session.ids[len(prompt) :]
        assert generated == greedy_reencoding(model, prompt, 12, fmt.stop_ids)
        assert session.ids == prompt + generated and session.engine.cache.positions[0] == len(session.ids)
        assert reply == tok.decode([t for t in generated if t not in fmt.stop_ids])
        assert prompt[: len(before)] == before  # the cache held a prefix of this turn's prompt ...
        assert session.encoded - encoded == len(prompt) - len(before)  # ... and only the rest was read
    assert session.engine.cache.length > 64  # it grew past its first allocation, its contents carried over
    assert [m["role"] for m in session.messages] == ["system"] + ["user", "assistant"] * 3


def test_a_reply_the_tokenizer_would_encode_otherwise_rewinds_the_cache_to_where_they_agree():
    """A byte-level BPE's sampled ids are often not those its encoder gives the reply's text: the next turn's
    rendering differs from the cache after the common prefix, which is all that is kept."""
    from conftest import tiny_corpus

    from quillgpt.chat_template import common_prefix
    from quillgpt.tokenizer import train_tokenizer

    tok = with_chat_tokens(train_tokenizer("bpe", [tiny_corpus(20_000) + "?+0123456789'"], 300, eot=True))
    torch.manual_seed(1)
    model = GPT(GPTConfig(block_size=256, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32)).eval()
    fmt = chat_format(tok)
    session = ChatSession(model, tok, max_new_tokens=10)
    rewound = 0
    for text in TURNS:
        before, encoded = list(session.ids), session.encoded
        prompt = fmt.prompt_ids(session.messages + [{"role": "user", "content": text}])
        session.reply(text)
        assert session.ids[len(prompt) :] == greedy_reencoding(model, prompt, 10, fmt.stop_ids)
        kept = common_prefix(before, prompt)
        assert session.encoded - encoded == len(prompt) - kept
        rewound += kept < len(before)
    assert rewound  # the case this test is for happened


def test_a_reply_stops_at_the_end_of_turn_token_which_the_cache_keeps():
    (model, n), tok = stopping_model(after=2), chat_tokenizer()
    fmt = chat_format(tok)
    session = ChatSession(model, tok, max_new_tokens=40)
    reply = session.reply(TURNS[0])
    assert len(reply) == n and session.ids[-1] == tok.special_tokens["<|im_end|>"]
    rendered = fmt.encode(session.messages)[0]  # "...<|im_start|>assistant\n" + reply + "<|im_end|>\n"
    assert session.ids == rendered[:-1] and tok.decode(rendered[-1:]) == "\n"
    encoded = session.encoded
    session.reply(TURNS[1])
    assert session.encoded - encoded == len(fmt.prompt_ids(session.messages[:-1])) - len(rendered) + 1


def test_the_oldest_turns_go_when_the_conversation_outgrows_the_context():
    model, tok = random_chat_model(block_size=96), chat_tokenizer()
    fmt = chat_format(tok)
    notices = io.StringIO()
    session = ChatSession(model, tok, system="Be brief.", max_new_tokens=16, notices=notices)
    for text in TURNS:
        prompt_if_kept = fmt.prompt_ids(session.messages + [{"role": "user", "content": text}])
        session.reply(text)
        prompt = fmt.prompt_ids(session.messages[:-1])
        assert len(prompt) + 16 <= 96
        assert session.ids[len(prompt) :] == greedy_reencoding(model, prompt, 16, fmt.stop_ids)
    assert "dropped the oldest" in notices.getvalue() and len(prompt_if_kept) + 16 > 96
    assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert session.messages[1]["content"] != TURNS[0]


def test_a_message_longer_than_the_context_is_an_error_and_the_conversation_goes_on():
    model, tok = random_chat_model(block_size=64), chat_tokenizer()
    session = ChatSession(model, tok, max_new_tokens=8, notices=None)
    session.reply("Hi")
    kept = [dict(m) for m in session.messages]
    with pytest.raises(UserError, match="context is 64"):
        session.reply("x" * 80)
    assert session.messages == kept
    session.reply("Hello")
    assert len(session.messages) == 4


def test_compiling_a_conversations_step_asks_for_the_whole_context_once(tmp_path, monkeypatch):
    """chat.py --compile compiles the decoding step for the model's whole context, which a conversation grows into,
    not for each cache length it passes through (a compile takes tens of seconds), and before the first message, so
    that a compile that fails (no C++ compiler) ends the session at once. The compile itself is test_decoding.py's."""
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path))
    asked = []

    def compile_package(model, cache, key):
        asked.append(cache.length)
        raise KeyboardInterrupt  # as a user stopping the compile: nothing is kept

    monkeypatch.setattr(compiled_step, "compile_package", compile_package)
    model = random_chat_model(block_size=256)
    _, plan = plan_decoding(model, torch.device("cpu"), "fp32", compile=True)
    with pytest.raises(KeyboardInterrupt):
        ChatSession(model, chat_tokenizer(), max_new_tokens=16, plan=plan)
    assert asked == [256]  # a first turn would need 64 positions


def test_a_tokenizer_without_a_chat_template_is_refused():
    with pytest.raises(UserError, match="no chat template"):
        ChatSession(random_chat_model(), CharTokenizer(CHARS, eot=True))


# ---- the command line ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory) -> tuple[Path, int]:
    model, n = stopping_model(after=3)
    return save_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt_best.pt", model), n


def library_replies(ckpt: Path, turns: list[str], system: str | None = None) -> list[str]:
    model, tok, _ = load_for_sampling(ckpt, "cpu", "fp32")
    session = ChatSession(model, tok, system=system, max_new_tokens=20)
    return [session.reply(t) for t in turns]


def test_chat_cli_streams_replies_and_obeys_reset_system_and_quit(chat_ckpt):
    chat_ckpt, _ = chat_ckpt
    script = f"{TURNS[0]}\n{TURNS[1]}\n/reset\n{TURNS[0]}\n/system Be brief.\n{TURNS[1]}\n/quit\n{TURNS[2]}\n"
    proc = run_chat(
        "--ckpt", str(chat_ckpt), "--temperature", "0", "--max-new-tokens", "20", "--dtype", "fp32", input=script
    )
    assert proc.returncode == 0, proc.stderr
    two_turns = library_replies(chat_ckpt, TURNS[:2])
    with_system = library_replies(chat_ckpt, TURNS[1:2], system="Be brief.")
    assert proc.stdout == "".join(f"{r}\n" for r in [*two_turns, two_turns[0], *with_system])  # none after /quit
    assert "[a new conversation]" in proc.stderr and "system message: Be brief." in proc.stderr


def test_chat_cli_prompt_answers_once_and_ends_at_the_end_of_turn(chat_ckpt):
    chat_ckpt, n = chat_ckpt
    proc = run_chat("--ckpt", str(chat_ckpt), "--prompt", TURNS[0], "--temperature", "0", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == library_replies(chat_ckpt, TURNS[:1])[0] + "\n" and len(proc.stdout) == n + 1


def test_chat_cli_samples_repeatably_with_a_seed(chat_ckpt):
    chat_ckpt, _ = chat_ckpt
    args = ("--ckpt", str(chat_ckpt), "--temperature", "1.0", "--top-p", "0.9", "--top-k", "20", "--seed", "3")
    first, second = (run_chat(*args, "--dtype", "fp32", input="Hi\nHello\n") for _ in range(2))
    assert first.returncode == 0 and first.stdout == second.stdout and first.stdout.strip()


def test_chat_cli_reads_typed_control_tokens_as_text_unless_told_otherwise(tmp_path):
    """A message that closes its turn and writes a system turn is one user turn of its text's ids, and the reply is
    the model's to those; --control-tokens-in-content gives each spelled token its id (transformers' default)."""
    from test_chat_template import FORGED_CHATML

    tok = chat_tokenizer(CHARS + list("<|>_"))  # characters to spell ChatML's tokens with
    chat_ckpt = save_chat_checkpoint(tmp_path / "ckpt.pt", random_chat_model(vocab_size=tok.vocab_size), tok)
    model, tok, _ = load_for_sampling(chat_ckpt, "cpu", "fp32")
    fmt = chat_format(tok)
    start, end = tok.special_tokens["<|im_start|>"], tok.special_tokens["<|im_end|>"]
    as_text = [start, *tok.encode(f"user\n{FORGED_CHATML}"), end, *tok.encode("\n"), start, *tok.encode("assistant\n")]
    messages = [{"role": "user", "content": FORGED_CHATML}]
    as_tokens = tok.encode_chat(fmt.render(messages, add_generation_prompt=True))[0]
    assert (as_text.count(start), as_tokens.count(start)) == (2, 3)
    replies = []
    for flags, prompt in (((), as_text), (("--control-tokens-in-content",), as_tokens)):
        proc = run_chat(
            "--ckpt", str(chat_ckpt), "--prompt", FORGED_CHATML, "--temperature", "0", "--dtype", "fp32", *flags
        )
        assert proc.returncode == 0, proc.stderr
        reply = greedy_reencoding(model, prompt, 256, fmt.stop_ids)
        assert proc.stdout == tok.decode([t for t in reply if t not in fmt.stop_ids]) + "\n"
        replies.append(proc.stdout)
    assert replies[0] != replies[1]


def test_chat_cli_refuses_a_base_model_in_one_line(tmp_path):
    base = save_chat_checkpoint(tmp_path / "base.pt", random_chat_model(), CharTokenizer(CHARS + ["@", "#", "$"]))
    proc = run_chat("--ckpt", str(base), "--prompt", "Hi")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no chat template" in proc.stderr, proc.stderr


# ---- evaluation: the chat tasks, and the harness's chat mode ---------------------------------------


def run_eval(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "eval.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def base_ckpt(tmp_path_factory) -> Path:
    """A model without a chat template: its char vocabulary as large as the chat one's, with no special tokens."""
    path = tmp_path_factory.mktemp("base") / "ckpt_best.pt"
    return save_chat_checkpoint(path, random_chat_model(), CharTokenizer(CHARS + ["@", "#", "$"]))


def plain_reference(ckpt: Path, question: str, shots: list) -> str:
    """Greedy text after the few-shot prompt, by whole-sequence forward passes, up to the end of the line."""
    from quillgpt.evaluate import ANSWER_TOKENS
    from quillgpt.tasks import Item, plain_prompt

    model, tok, _ = load_for_sampling(ckpt, "cpu", "fp32")
    prompt = tok.encode(plain_prompt(Item("", "", question, ""), shots))
    text = tok.decode(greedy_reencoding(model, prompt, ANSWER_TOKENS, stop=set()))
    return text.split("\n")[0]


def test_eval_grades_held_out_chat_task_answers_in_the_template_or_few_shot(chat_ckpt, base_ckpt, tmp_path):
    from quillgpt.evaluate import ANSWER_TOKENS, FEW_SHOT
    from quillgpt.tasks import grade, sample_items

    chat_ckpt, _ = chat_ckpt
    for ckpt, form in ((chat_ckpt, "chat template"), (base_ckpt, f"plain, up to {FEW_SHOT}-shot")):
        out = tmp_path / f"{ckpt.parent.name}.json"
        proc = run_eval(
            *("--ckpt", str(ckpt), "--chat-task", "arithmetic,reverse", "--chat-items", "4", "--json", str(out)),
            *("--precision", "fp32"),  # the references below decode in fp32; auto may pick bf16 at scoring's shape
        )
        assert proc.returncode == 0, proc.stderr
        report = json.loads(out.read_text())["chat_tasks"]
        assert report["form"] == form and list(report["tasks"]) == ["arithmetic", "reverse"]
        assert f"chat task reverse ({form}, greedy): acc" in proc.stdout
        for task, result in report["tasks"].items():
            items = sample_items(task, "test", 4, seed=0, distinct=True)
            assert [e["question"] for e in result["examples"]] == [i.question for i in items]
            assert result["correct"] == sum(grade(i, e["reply"]) for i, e in zip(items, result["examples"]))
            assert result["items"] == 4 and result["acc"] == result["correct"] / 4
            if ckpt == chat_ckpt:
                model, tok, _ = load_for_sampling(ckpt, "cpu", "fp32")
                expected = [ChatSession(model, tok, max_new_tokens=ANSWER_TOKENS).reply(i.question) for i in items]
            else:
                shots = sample_items(task, "train", FEW_SHOT, seed=0, distinct=True)
                expected = [plain_reference(ckpt, i.question, shots) for i in items]
            assert [e["reply"] for e in result["examples"]] == expected


def test_eval_rejects_an_unknown_chat_task_before_loading_anything(tmp_path):
    proc = run_eval("--ckpt", str(tmp_path / "missing.pt"), "--chat-task", "arithmetic,poetry")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown chat task poetry" in proc.stderr


def write_chat_harness_task(directory: Path) -> tuple[Path, list]:
    """A harness task over local files: held-out arithmetic questions, answers graded by exact match."""
    from quillgpt.tasks import sample_items

    items = sample_items("arithmetic", "test", 4, seed=0, distinct=True)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "items.jsonl"
    data.write_text("".join(json.dumps({"question": i.question, "answer": i.answer}) + "\n" for i in items))
    (directory / "chat_sums.yaml").write_text(
        f"task: chat_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        'output_type: generate_until\ntest_split: test\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\nmetric_list:\n  - metric: exact_match\n'
        "    aggregation: mean\n    higher_is_better: true\n"
    )
    return directory, items


@pytest.mark.slow
def test_harness_chat_mode_renders_requests_in_the_template_and_answers_as_chat_does(chat_ckpt, tmp_path):
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from quillgpt.lm_harness import QuillLM

    seen = []

    class Recording(QuillLM):
        def generate_until(self, requests):
            out = super().generate_until(requests)
            seen.extend((r.args[0], o) for r, o in zip(requests, out))
            return out

    task_dir, items = write_chat_harness_task(tmp_path / "tasks")
    model, tok, _ = load_for_sampling(chat_ckpt[0], "cpu", "fp32")
    fmt = chat_format(tok)
    lm = Recording(model, tok, chat=True)
    results = simple_evaluate(
        model=lm,
        tasks=["chat_sums"],
        task_manager=TaskManager(include_path=str(task_dir)),
        apply_chat_template=True,
        log_samples=False,
        bootstrap_iters=0,
        verbosity="ERROR",
    )
    asked = {i.question: [{"role": "user", "content": i.question}] for i in items}
    assert sorted(context for context, _ in seen) == sorted(fmt.render(m, True) for m in asked.values())
    for context, output in seen:
        messages = next(m for m in asked.values() if fmt.render(m, True) == context)
        assert lm.encode_context(context) == fmt.prompt_ids(messages)  # special tokens read as their ids
        assert output == ChatSession(model, tok, max_new_tokens=12).reply(messages[0]["content"]).split("\n")[0]
    assert results["results"]["chat_sums"]["exact_match,none"] == 0.0  # a random model
    assert lm.chat_template(True) == tok.chat_template and lm.tokenizer_name.startswith("quillgpt-char-")
    ctx, cont = lm.encode_pair(fmt.render(messages, True), "42")
    assert ctx == fmt.prompt_ids(messages) and cont == tok.encode("42")


@pytest.mark.slow
def test_eval_passes_apply_chat_template_to_the_harness_and_refuses_a_base_model(chat_ckpt, base_ckpt, tmp_path):
    pytest.importorskip("lm_eval")
    task_dir, _ = write_chat_harness_task(tmp_path / "tasks")
    args = ("--tasks", "chat_sums", "--task-dir", str(task_dir), "--apply-chat-template")
    proc = run_eval("--ckpt", str(chat_ckpt[0]), *args, "--json", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr
    assert "exact_match" in json.loads((tmp_path / "r.json").read_text())["harness"]["chat_sums"]
    base = run_eval("--ckpt", str(base_ckpt), *args)
    assert base.returncode == 2 and "no chat template" in base.stderr.splitlines()[-1], base.stderr
    alone = run_eval("--ckpt", str(base_ckpt), "--apply-chat-template")
    assert alone.returncode == 2 and "give --tasks" in alone.stderr


def test_chat_task_evaluation_runs_under_bf16_autocast(chat_ckpt, tmp_path):
    """Under autocast the new keys and values are bf16 while the KV cache keeps the weights' fp32."""
    chat_ckpt, _ = chat_ckpt
    proc = run_eval("--ckpt", str(chat_ckpt), "--chat-task", "count", "--chat-items", "3", "--precision", "bf16")
    assert proc.returncode == 0, proc.stderr
    assert "bf16 on cpu" in proc.stdout and "chat task count (chat template, greedy): acc" in proc.stdout


def test_transformers_chats_with_our_export_and_replies_as_we_do(tmp_path):
    """export.py --hf carries the chat template and the chat tokens: transformers renders the conversation, and its
    greedy reply, ended at <|im_end|>, is ours."""
    transformers = pytest.importorskip("transformers")
    model, n = stopping_model(after=3, pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False)  # Llama's switches
    chat_ckpt = save_chat_checkpoint(tmp_path / "ckpt_best.pt", model)
    out = tmp_path / "hf"
    proc = subprocess.run(
        [sys.executable, "export.py", "--ckpt", str(chat_ckpt), "--hf", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    messages = [{"role": "user", "content": TURNS[0]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    generated = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False, eos_token_id=end, pad_token_id=end
    )[0, ids.shape[1] :]
    assert generated[-1] == end and len(generated) == n + 1  # the reply, then its end-of-turn token
    assert tok.decode(generated[:-1]) == library_replies(chat_ckpt, TURNS[:1])[0]


@pytest.mark.parametrize("rows_per_pass, prompts_per_read", [(1, None), (7, None), (1000, None), (1000, 3)])
def test_chat_task_answers_decoded_together_are_each_questions_reply_alone(
    monkeypatch, rows_per_pass, prompts_per_read
):
    """replies.chat_answers decodes every question's reply in one batch (or passes of a few rows, the cache's
    bound), a finished reply leaving the batch, its prompts read together, right-padded (or a few at a time, the
    logits' bound): each reply is ChatSession's to that question alone, with replies ending at different steps."""
    from quillgpt import engine, evaluate, replies
    from quillgpt.replies import sample_groups
    from quillgpt.tasks import sample_items

    model, tok = random_chat_model(block_size=96, n_kv_head=1), chat_tokenizer()
    end = tok.special_tokens["<|im_end|>"]
    with torch.no_grad():  # end the turn now and then: rows finish at different steps
        model.lm_head.weight[end] *= 5 / model.lm_head.weight[end].norm()
    model.eval()
    questions = [i.question for name in ("count", "reverse") for i in sample_items(name, "val", 9, seed=0)]
    longest = max(len(chat_format(tok).prompt_ids([{"role": "user", "content": q}])) for q in questions)
    cfg = model.config
    row = 2 * cfg.n_layer * cfg.kv_heads * cfg.head_width * 4 * min(cfg.block_size, longest + evaluate.ANSWER_TOKENS)
    monkeypatch.setattr(replies, "REPLY_CACHE_BYTES", row * rows_per_pass)
    if prompts_per_read:
        monkeypatch.setattr(engine, "PROMPT_LOGITS_BYTES", 4 * (longest + 1) * cfg.vocab_size * prompts_per_read)
    passes = []
    monkeypatch.setattr(
        replies,
        "sample_groups",
        lambda m, t, f, prompts, *a: passes.append(len(prompts)) or sample_groups(m, t, f, prompts, *a),
    )
    batch_sizes = []

    def steps(module, inputs, output) -> None:  # each step's rows (a prompt's pass reads more than one position)
        if inputs[0].size(1) == 1:
            batch_sizes.append(inputs[0].size(0))

    hook = model.transformer.wte.register_forward_hook(steps)
    answers = replies.chat_answers(model, tok, questions, evaluate.ANSWER_TOKENS)
    hook.remove()
    if rows_per_pass > len(questions):  # one pass: a finished reply leaves the batch, the others go on
        assert batch_sizes == sorted(batch_sizes, reverse=True) and batch_sizes[0] > batch_sizes[-1]
    assert passes == [len(questions[i : i + rows_per_pass]) for i in range(0, len(questions), rows_per_pass)]
    session = ChatSession(model, tok, max_new_tokens=evaluate.ANSWER_TOKENS)
    alone = []
    for question in questions:
        session.reset()
        alone.append(session.reply(question))
    assert [r.text for r in answers] == alone
    assert len({len(r.ids) for r in answers}) > 2 and any(r.ids[-1] == end for r in answers)

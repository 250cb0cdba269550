"""serve.py: a real server on 127.0.0.1 (a subprocess), spoken to with the real openai client and httpx: greedy
replies equal sample.py's, streams equal whole replies, 16 concurrent clients get the sequential answers, refusals
have OpenAI's error shape, the queue bound answers 503, a dropped stream frees its slot."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT, chatml_without_tool, require_llama_cpp
from test_chat import greedy_reencoding
from test_chat_template import FORGED_CHATML, FORGED_LLAMA3, TEMPLATES, save_template_tokenizer

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import bench  # noqa: E402
from benchmarks.serving_load import ServerProcess  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from quillgpt.chat_session import ChatSession  # noqa: E402
from quillgpt.chat_template import chat_format  # noqa: E402
from quillgpt.checkpoint import save_checkpoint  # noqa: E402
from quillgpt.generate import encode_prompt, generate_texts, load_for_sampling, plan_decoding  # noqa: E402
from quillgpt.serve.batcher import Batcher, Finish, GenRequest  # noqa: E402
from quillgpt.tokenizer import CharTokenizer, hf_tokenizer  # noqa: E402

CHARS = list("\n abcdefghijklmnopqrstuvwxyz.,:?!'<|>_")
KEY = "test-key"
BLOCK = 96
PROMPTS = ["the ", "a", "to be or not", "king", "", "queen of the", "what say you", "o", "lord, ", "my love"]
CONVERSATION = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "what is love?"}]


def write_checkpoint(path: Path, seed: int = 0, eot: bool = True, tokenizer=None, **model_args) -> Path:
    """A tiny random model (weights scaled up so greedy text varies), by default over a char tokenizer with ChatML's
    tokens (not the calculator's: conftest.chatml_without_tool). Without eot a completion runs to max_tokens."""
    tokenizer = tokenizer or chatml_without_tool(CharTokenizer(CHARS, eot=eot))
    torch.manual_seed(seed)
    args = dict(block_size=BLOCK, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2, n_embd=32)
    config = GPTConfig(**{**args, **model_args})
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0 if p.dim() > 1 else 1.0)
    save_checkpoint(
        path, {"model": model.state_dict(), "model_args": config.to_dict(), "tokenizer": tokenizer.to_dict()}
    )
    return path


class Server(ServerProcess):
    """serve.py in a subprocess on 127.0.0.1 (a port it picks itself), in fp32, with the test's API key."""

    def __init__(self, ckpt: Path, *flags: str):
        super().__init__(ckpt, "--dtype", "fp32", *flags, api_key=KEY)

    def post(self, path: str, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", headers={"Authorization": f"Bearer {KEY}", **(headers or {})}, **kw)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt_best.pt")


@pytest.fixture(scope="module")
def server(ckpt):
    s = Server(ckpt, "--model-name", "tiny", "--max-queue", "8", "--max-body-kb", "4")
    yield s
    s.close()


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    """One slot and a queue of one, on a model slow enough that a long reply holds its slot for seconds (and with no
    end-of-text id to end it sooner)."""
    path = tmp_path_factory.mktemp("busy") / "ckpt_best.pt"
    ckpt = write_checkpoint(path, eot=False, block_size=2048, n_layer=4, n_embd=256)
    s = Server(ckpt, "--model-name", "busy", "--max-batch", "1", "--max-queue", "1")
    yield s
    s.close()


@pytest.fixture(scope="module")
def loaded(ckpt):
    model, tokenizer, _ = load_for_sampling(ckpt, "cpu", "fp32")
    return model, tokenizer


def complete(client, prompt: str, **kw) -> str:
    kw = {"max_tokens": 40, "temperature": 0, **kw}
    return client.completions.create(model="tiny", prompt=prompt, **kw).choices[0].text


def streamed_completion(client, prompt: str, **kw) -> str:
    kw = {"max_tokens": 40, "temperature": 0, **kw}
    return "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt=prompt, stream=True, **kw))


def chat(client, messages: list[dict], **kw) -> str:
    kw = {"max_tokens": 40, "temperature": 0, **kw}
    return client.chat.completions.create(model="tiny", messages=messages, **kw).choices[0].message.content


def greedy_chat_reference(loaded, messages: list[dict], max_tokens: int) -> str:
    """The reply as the model gives it alone, without a cache (greedy_reply), ended at the template's end-of-turn
    ids."""
    return greedy_reply(loaded, chat_format(loaded[1]).prompt_ids(messages), max_tokens)


def greedy_reply(loaded, prompt: list[int], max_tokens: int) -> str:
    """The greedy reply to these prompt ids, each token from a forward pass over the whole sequence (no cache),
    ended at the chat template's end ids."""
    model, tokenizer = loaded
    fmt = chat_format(tokenizer)
    ids = [t for t in greedy_reencoding(model, prompt, max_tokens, fmt.stop_ids) if t not in fmt.stop_ids]
    return tokenizer.decode_after(prompt[-8:], ids)


# ---- replies ------------------------------------------------------------------------------------------


def test_greedy_completions_equal_sample_py(server, ckpt, loaded):
    client = server.client()
    model, tokenizer = loaded
    for prompt in PROMPTS:
        ids = encode_prompt(tokenizer, prompt, BLOCK)
        assert complete(client, prompt) == generate_texts(model, tokenizer, ids, 1, 40, temperature=0)[0][0], prompt
    cli = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(ckpt), "--prompt", "king", "--max-new-tokens", "40"]
        + ["--temperature", "0", "--dtype", "fp32", "--no-stream"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == "king" + complete(client, "king") + "\n"


def test_with_default_flags_serve_py_and_sample_py_pick_one_precision_and_the_same_greedy_text(ckpt):
    """auto decides the precision at one decoding row in both (on a CPU with native bf16, a 16-row step measures bf16
    faster where one row runs faster in fp32, and the two used to pick differently): serve.py started with no
    --dtype or --device and sample.py with no flags but greedy decoding write the same text."""
    prompts = [p for p in PROMPTS if p]  # sample.py --interactive reads one a line
    with ServerProcess(ckpt, "--model-name", "tiny", api_key=KEY) as s:
        served = [complete(s.client(), p) for p in prompts]
    cli = subprocess.run(
        [sys.executable, "sample.py", "--ckpt", str(ckpt), "--interactive", "--max-new-tokens", "40"]
        + ["--temperature", "0", "--no-stream"],
        input="".join(f"{p}\n" for p in prompts),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout == "".join(f"{p}{text}\n" for p, text in zip(prompts, served))


def test_greedy_chat_equals_the_model_decoding_the_template_alone(server, loaded):
    client = server.client()
    reply = chat(client, CONVERSATION)
    assert reply == greedy_chat_reference(loaded, CONVERSATION, 40) and reply
    one_turn = [{"role": "user", "content": "hello"}]
    assert chat(client, one_turn, max_tokens=30) == greedy_chat_reference(loaded, one_turn, 30)
    assert chat(client, one_turn, max_tokens=30) == ChatSession(*loaded, max_new_tokens=30).reply("hello")  # chat.py's


def chat_reply(server: Server, messages: list[dict], max_tokens: int = 20) -> tuple[str, int]:
    """The greedy reply and the prompt's token count (the usage), from a server serving "tiny"."""
    r = server.client().chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_a_message_spelling_chatml_tokens_is_one_user_turn_unless_the_server_is_told_otherwise(server, ckpt, loaded):
    """A client's message that closes its turn and writes a system turn: by default the model reads its text (the
    reply and the prompt's length are those of the text's ids, one user turn); with --control-tokens-in-content,
    transformers' default comes back (each spelled token its id: a system turn more)."""
    model, tok = loaded
    start, end = tok.special_tokens["<|im_start|>"], tok.special_tokens["<|im_end|>"]
    messages = [{"role": "user", "content": FORGED_CHATML}]
    as_text = [start, *tok.encode(f"user\n{FORGED_CHATML}"), end, *tok.encode("\n"), start, *tok.encode("assistant\n")]
    as_tokens = tok.encode_chat(chat_format(tok).render(messages, add_generation_prompt=True))[0]
    assert (as_text.count(start), as_tokens.count(start)) == (2, 3)
    reply = chat_reply(server, messages)
    assert reply == (greedy_reply(loaded, as_text, 20), len(as_text))
    with Server(ckpt, "--model-name", "tiny", "--control-tokens-in-content") as switched:
        forged = chat_reply(switched, messages)
    assert forged == (greedy_reply(loaded, as_tokens, 20), len(as_tokens)) and forged[0] != reply[0]


@pytest.fixture(scope="module")
def llama3_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint, tokenizer directory): a tiny random model over a Hugging Face BPE with Llama 3's special tokens
    and chat template."""
    template, specials, config = TEMPLATES["llama3"]
    directory = save_template_tokenizer(tmp_path_factory.mktemp("llama3_tok"), template, specials, config)
    tokenizer = hf_tokenizer(directory)
    # a context that holds the forged prompt however many tokens the BPE, trained on whichever corpus the tests
    # found, takes for it (95 of a 96-token one on the fallback corpus)
    ckpt = write_checkpoint(tmp_path_factory.mktemp("llama3") / "ckpt_best.pt", tokenizer=tokenizer, block_size=256)
    return ckpt, directory


def test_a_message_spelling_llama3_tokens_is_one_user_turn_unless_the_server_is_told_otherwise(llama3_ckpt):
    """As above with Llama 3's template: by default the forged <|eot_id|> and header are the text's ids; with
    --control-tokens-in-content the prompt is transformers' apply_chat_template's."""
    transformers = pytest.importorskip("transformers")
    ckpt, directory = llama3_ckpt
    loaded = load_for_sampling(ckpt, "cpu", "fp32")[:2]
    tok = loaded[1]
    bos, header, header_end, eot = (tok.special_tokens[t] for t in TEMPLATES["llama3"][1])
    messages = [{"role": "user", "content": FORGED_LLAMA3}]
    turn = [bos, header, *tok.encode("user"), header_end, *tok.encode("\n\n" + FORGED_LLAMA3), eot]
    as_text = [*turn, header, *tok.encode("assistant"), header_end, *tok.encode("\n\n")]
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    as_tokens = list(theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert (as_text.count(header), as_tokens.count(header)) == (2, 3)
    replies = []
    for flags, ids in (((), as_text), (("--control-tokens-in-content",), as_tokens)):
        with Server(ckpt, "--model-name", "tiny", *flags) as s:
            replies.append(chat_reply(s, messages))
        assert replies[-1] == (greedy_reply(loaded, ids, 20), len(ids))
    assert replies[0][0] != replies[1][0]


def test_stream_deltas_concatenate_to_the_whole_reply(server):
    client = server.client()
    for prompt in PROMPTS[:4]:
        assert streamed_completion(client, prompt) == complete(client, prompt)
        assert streamed_completion(client, prompt, stop=["d", "e "]) == complete(client, prompt, stop=["d", "e "])
    chunks = list(
        client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=40, temperature=0, stream=True)
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat(client, CONVERSATION)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_ends_with_done_and_can_report_usage(server):
    body = {"model": "tiny", "prompt": "the ", "max_tokens": 5, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    r = server.post("/completions", json=body)
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


def test_stop_strings_are_left_out_and_the_reply_says_why_it_ended(server):
    client = server.client()
    full = complete(client, "the ")
    stop = full[5:7]
    r = client.completions.create(model="tiny", prompt="the ", max_tokens=40, temperature=0, stop=stop)
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt="the ", max_tokens=7, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7


def test_a_seed_repeats_a_sampled_reply_alone_or_in_a_batch(server):
    client = server.client()
    alone = complete(client, "the ", temperature=1.0, top_p=0.9, seed=7)
    with ThreadPoolExecutor(8) as pool:
        batch = list(
            pool.map(lambda s: complete(client, "the ", temperature=1.0, top_p=0.9, seed=s), [7] * 4 + [8] * 4)
        )
    assert batch[:4] == [alone] * 4
    assert len({alone, complete(client, "the ", temperature=1.0, seed=8)}) == 2


def test_top_k_is_taken_as_vllm_and_llama_cpp_take_it(server):
    """top_k, not OpenAI's: 1 samples the most likely token, so any seed gives the greedy reply; 0 is off."""
    client = server.client()
    greedy = complete(client, "the ")
    assert [complete(client, "the ", temperature=1.5, seed=s, extra_body={"top_k": 1}) for s in (1, 2)] == [greedy] * 2
    sampled = complete(client, "the ", temperature=1.5, seed=1)
    assert complete(client, "the ", temperature=1.5, seed=1, extra_body={"top_k": 0}) == sampled != greedy


def test_models_lists_the_one_model_served(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert server.client().models.retrieve("tiny").id == "tiny"


# ---- under load ---------------------------------------------------------------------------------------


def test_sixteen_concurrent_clients_get_the_sequential_greedy_answers(server):
    client = server.client()
    jobs = [(PROMPTS[i % len(PROMPTS)], 20 + 3 * i) for i in range(16)]  # lengths differ: requests leave mid-batch
    sequential = [complete(client, p, max_tokens=n) for p, n in jobs]
    chats = [[{"role": "user", "content": p or "hi"}] for p, _ in jobs[:4]]
    sequential_chats = [chat(client, m) for m in chats]
    start = threading.Barrier(20)

    def run(job):
        start.wait()
        return complete(client, *job[:1], max_tokens=job[1]) if len(job) == 2 else chat(client, job[0])

    with ThreadPoolExecutor(20) as pool:
        concurrent = list(pool.map(run, jobs + [(m,) for m in chats]))
    assert concurrent == sequential + sequential_chats
    assert server.health() == {"status": "ok", "active": 0, "queued": 0}


def batcher_replies(batcher: Batcher, requests: list[tuple[int, GenRequest]]) -> tuple[list[str], list[int]]:
    """Run the batcher in this process on requests submitted at given steps ((step, request), in step order): each
    reply's text, and how many requests were active at each step."""
    loop = asyncio.new_event_loop()
    handles, active, waiting = [], [], list(requests)
    decode_step = batcher.step

    def submit_due() -> None:
        while waiting and waiting[0][0] <= len(active):
            handles.append(batcher.submit(waiting.pop(0)[1], loop))
            batcher.admit()

    def step() -> None:
        submit_due()
        active.append(len(batcher.engine.rows))
        decode_step()

    submit_due()
    batcher.step = step
    batcher.run(until=lambda: not (waiting or batcher.engine.rows or batcher.pending))
    loop.run_until_complete(asyncio.sleep(0))  # the replies' text, put on their queues from the batcher
    replies = []
    for handle in handles:
        items = [handle.queue.get_nowait() for _ in range(handle.queue.qsize())]
        assert isinstance(items[-1], Finish) and items[-1].reason != "error", items[-1]
        replies.append("".join(items[:-1]))
    loop.close()
    return replies, active


def test_without_a_kept_step_the_batcher_compiles_nothing_and_decodes_eagerly(loaded, tmp_path, monkeypatch):
    """serve.py's default takes a kept compiled step only: with none kept (an empty cache), or --no-compile, a lone
    request runs the rows' eager step and start-up compiles nothing."""
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path))
    model, tokenizer = loaded
    for compile in (None, False):
        plan = plan_decoding(model, torch.device("cpu"), "fp32", compile)[1]
        assert not Batcher(model, tokenizer, plan=plan).lone
    assert not list(tmp_path.rglob("*.pt2"))


@pytest.mark.slow
def test_a_lone_request_is_decoded_by_the_compiled_step_and_hands_over_to_the_batch(
    ckpt, loaded, server, tmp_path, monkeypatch
):
    """serve.py --compile: a request decoded alone runs the compiled one-token step (kept on disk, as chat.py
    --compile keeps it) over row 0 of the slot cache; when a second request joins, the rows' eager step takes the
    first one over mid-reply, and gives it back when the second leaves. Every reply is the eager batcher's, and a
    later serve.py of the model's shape uses the kept step with no flag."""
    monkeypatch.setenv("QUILLGPT_CACHE", str(tmp_path))  # the package kept here serves no other test's server
    model, tokenizer = loaded
    long, short = GenRequest(tokenizer.encode("the king "), 60, 0.0), GenRequest(tokenizer.encode("o"), 12, 0.0)
    plan = [(0, long), (10, short)]  # the short one joins at step 10 and leaves before the long one ends
    eager, eager_active = batcher_replies(Batcher(model, tokenizer, max_batch=4), plan)
    compiled_plan = plan_decoding(model, torch.device("cpu"), "fp32", True)[1]
    batcher = Batcher(model, tokenizer, max_batch=4, plan=compiled_plan)
    compiled = batcher.engine.lone
    lone_steps = []
    batcher.engine.lone = lambda *a: lone_steps.append(1) or compiled(*a)  # counts the compiled step's calls
    replies, active = batcher_replies(batcher, plan)
    assert replies == eager and active == eager_active
    assert len(lone_steps) == active.count(1) and 1 in active and 2 in active
    assert active.index(2) < len(active) - 1 - active[::-1].index(2) < len(active) - 1  # alone again after the batch

    with Server(ckpt, "--model-name", "tiny") as kept, Server(ckpt, "--model-name", "tiny", "--no-compile") as off:
        assert "a lone request by the compiled step" in kept.started and "compiled" not in off.started
        client, sequential = kept.client(), [(p, 20 + 7 * i) for i, p in enumerate(PROMPTS[:4])]
        assert [complete(client, p, max_tokens=n) for p, n in sequential] == [
            complete(server.client(), p, max_tokens=n) for p, n in sequential
        ]


def test_past_the_queue_bound_the_server_answers_503_with_retry_after(busy_server):
    long = {"model": "busy", "prompt": "the ", "max_tokens": 1500, "temperature": 0, "stream": True}
    client = httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    with client.stream("POST", f"{busy_server.base}/completions", json=long) as first:
        lines = first.iter_lines()  # kept: a dropped iterator closes the connection, which cancels the request
        next(lines)  # decoding: the one slot is taken
        with client.stream("POST", f"{busy_server.base}/completions", json=long) as second:
            wait_for(lambda: busy_server.health()["queued"] == 1)
            third = busy_server.post("/completions", json={**long, "stream": False})
            assert third.status_code == 503 and third.headers["Retry-After"] == "1"
            assert third.json()["error"]["code"] == "server_overloaded"
            assert second.status_code == 200
    wait_for(lambda: busy_server.health()["active"] == 0)


def test_a_client_that_drops_a_stream_frees_its_slot(busy_server):
    client = busy_server.client()
    stream = client.completions.create(model="busy", prompt="the ", max_tokens=1500, temperature=0, stream=True)
    next(iter(stream))
    assert busy_server.health()["active"] == 1
    stream.close()  # long before 1,500 tokens are decoded
    wait_for(lambda: busy_server.health() == {"status": "ok", "active": 0, "queued": 0})
    assert client.completions.create(model="busy", prompt="a", max_tokens=3).choices[0].finish_reason == "length"


def wait_for(condition, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---- bad input and security ---------------------------------------------------------------------------

BAD_REQUESTS = {
    "malformed JSON": ("/completions", b'{"model": "tiny", "prompt": ', None),
    "a list, not an object": ("/completions", b"[1, 2]", None),
    "a string temperature": ("/completions", {"model": "tiny", "prompt": "a", "temperature": "hot"}, "temperature"),
    "a string max_tokens": ("/completions", {"model": "tiny", "prompt": "a", "max_tokens": "10"}, "max_tokens"),
    "a number prompt": ("/completions", {"model": "tiny", "prompt": 5}, "prompt"),
    "messages not a list": ("/chat/completions", {"model": "tiny", "messages": "hi"}, "messages"),
    "a message without content": ("/chat/completions", {"model": "tiny", "messages": [{"role": "user"}]}, "messages"),
    "an unknown model": ("/completions", {"model": "gpt-4", "prompt": "a"}, "model"),
    "a checkpoint path as the model": ("/completions", {"model": "/tmp/other/ckpt_best.pt", "prompt": "a"}, "model"),
    "empty messages": ("/chat/completions", {"model": "tiny", "messages": []}, "messages"),
    "max_tokens past the context": (
        "/completions",
        {"model": "tiny", "prompt": "the ", "max_tokens": BLOCK},
        "max_tokens",
    ),
    "a prompt past the context": ("/completions", {"model": "tiny", "prompt": "a" * BLOCK}, "prompt"),
    "a body over the size limit": ("/completions", {"model": "tiny", "prompt": "a" * 5000}, None),
    "a field naming a checkpoint": ("/completions", {"model": "tiny", "prompt": "a", "ckpt": "/etc/passwd"}, "ckpt"),
    "a field naming a template": (
        "/chat/completions",
        {"model": "tiny", "messages": CONVERSATION, "chat_template": "{{ 1 }}"},
        "chat_template",
    ),
    "two choices": ("/completions", {"model": "tiny", "prompt": "a", "n": 2}, "n"),
    "a negative top_k": ("/completions", {"model": "tiny", "prompt": "a", "top_k": -1}, "top_k"),
    "five stop strings": ("/completions", {"model": "tiny", "prompt": "a", "stop": list("abcde")}, "stop"),
    # every number at its edges: huge, negative, NaN, infinite (Python's JSON reads NaN and Infinity)
    "a seed past 64 bits": ("/completions", {"model": "tiny", "prompt": "a", "seed": 2**70}, "seed"),
    "a seed below -2**63": ("/completions", {"model": "tiny", "prompt": "a", "seed": -(2**70)}, "seed"),
    "a NaN temperature": ("/completions", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', "temperature"),
    "an infinite top_p": ("/completions", b'{"model": "tiny", "prompt": "a", "top_p": Infinity}', "top_p"),
    "a negative temperature": ("/completions", {"model": "tiny", "prompt": "a", "temperature": -1}, "temperature"),
    "a huge max_tokens": ("/completions", {"model": "tiny", "prompt": "a", "max_tokens": 2**70}, "max_tokens"),
    "a zero max_tokens": (
        "/chat/completions",
        {"model": "tiny", "messages": CONVERSATION, "max_tokens": 0},
        "max_tokens",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_a_bad_request_gets_a_400_in_openais_error_shape_and_the_server_stays_up(server, case):
    path, body, param = BAD_REQUESTS[case]
    headers = {"Content-Type": "application/json"}
    r = server.post(path, headers=headers, content=body if isinstance(body, bytes) else json.dumps(body))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]
    assert server.health()["status"] == "ok"
    assert complete(server.client(), "a", max_tokens=3)  # still serving


def test_the_openai_client_raises_bad_request_for_a_400(server):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client().completions.create(model="tiny", prompt="the ", max_tokens=10_000)


def test_a_body_streamed_past_the_limit_without_a_length_gets_a_400(server):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"a" * 1000
        yield b'"}'

    r = server.post("/completions", headers={"Content-Type": "application/json"}, content=chunks())
    assert r.status_code == 400 and r.json()["error"]["code"] == "body_too_large"


def test_without_the_bearer_key_a_request_gets_401(server):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(f"{server.base}/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base}/models").status_code == 401
    assert httpx.post(f"{server.root}/tokenize", json={"model": "tiny", "prompt": "a"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base, api_key="wrong", max_retries=0).models.list()
    assert server.post("/completions", json=body).status_code == 200


def test_tokenize_counts_a_prompt_or_a_conversation_as_the_endpoints_encode_them(server, loaded):
    """vLLM's /tokenize: the ids /v1/completions encodes a prompt to, or /v1/chat/completions renders a conversation
    to (the assistant's turn opened), and the context; a body with neither, or both, is a 400 in OpenAI's shape."""
    model, tokenizer = loaded
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{server.root}/tokenize", json={"model": "tiny", "messages": CONVERSATION}, headers=headers)
    ids = chat_format(tokenizer).prompt_ids(CONVERSATION)
    assert r.json() == {"count": len(ids), "max_model_len": BLOCK, "tokens": ids}
    r = httpx.post(f"{server.root}/tokenize", json={"model": "tiny", "prompt": "the king"}, headers=headers)
    assert r.json()["tokens"] == tokenizer.prompt_ids("the king")
    for body in (
        {"model": "tiny"},
        {"model": "tiny", "prompt": "a", "messages": CONVERSATION},
        {"model": "x", "prompt": "a"},
    ):
        r = httpx.post(f"{server.root}/tokenize", json=body, headers=headers)
        assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_binds_127_0_0_1_unless_told_otherwise(server):
    import serve

    assert serve.parse_args(["--ckpt", "x"]).host == "127.0.0.1"
    assert server.base.startswith("http://127.0.0.1:")


def test_a_taken_port_or_a_bad_checkpoint_is_one_line_and_exit_2(server, tmp_path):
    port = server.base.rsplit(":", 1)[1].split("/")[0]
    for args in (["--ckpt", "x", "--port", port], ["--ckpt", str(tmp_path / "missing.pt"), "--port", "0"]):
        r = subprocess.run(
            [sys.executable, "serve.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr


def test_bench_serve_tables_tokens_per_second_by_clients_and_checks_the_greedy_text(capsys):
    tiny = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "64"]
    bench.main(["--serve", "--clients", "1,4", "--requests", "2", "--max-tokens", "8", *tiny])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("yes") for row in rows), rows


def test_bench_serve_against_llama_cpp_tables_both_servers_on_the_same_model(capsys):
    """--vs-llama-cpp: llama-cpp-python's server on export.py's f32 GGUF of the bench model answers the same clients;
    in f32 its greedy replies are serve.py's."""
    require_llama_cpp("llama_cpp.server.app")
    tiny = ["--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.block_size", "64"]
    bench.main(["--serve", "--vs-llama-cpp", "--clients", "1,2", "--requests", "1", "--max-tokens", "8", *tiny])
    out = capsys.readouterr().out
    table = out.split("llama_cpp.server on the f32 GGUF")[1]
    rows = [line.split("|")[1:5] for line in table.splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert [int(r[0]) for r in rows] == [1, 2] and all(float(r[2].replace(",", "")) > 0 for r in rows), table
    assert "greedy replies of the two servers equal: yes" in out


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 0, ""), (signal.SIGINT, 130, "interrupted")])
def test_sigterm_ends_the_server_cleanly_and_ctrl_c_says_interrupted(ckpt, sig, code, said):
    """The batcher runs on the main thread and the web server on another: a signal still ends both, at once."""
    s = Server(ckpt, "--model-name", "tiny")
    assert s.health()
    s.proc.send_signal(sig)
    assert s.proc.wait(timeout=15) == code
    assert s.proc.stderr.read().strip() == said
    s.close()

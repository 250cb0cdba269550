"""serve.py's page at /, driven in headless Chromium (Debian's chromium and chromium-driver, through selenium) as a
person would use it, against real serve.py processes: a reply typed and sent with Enter is the API's greedy reply,
Stop frees the server's slot within a second, a reload keeps the conversations, a completion is sample.py's greedy
text, hostile text stays text, an API key is asked for before anything is sent, and no test leaves an error in the
browser's console. Without chromium, chromedriver or selenium every test here skips, naming what is missing.

The screenshot in the README is this module's: QUILLGPT_PAGE_SCREENSHOT=docs/chat_page.png writes it (with
QUILLGPT_PAGE_SCREENSHOT_CKPT=checkpoints/base-chat it shows that model instead of the tiny random one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import REPO_ROOT, chatml_without_tool
from test_serve import write_checkpoint

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the browser tests skip, naming it (missing_browser)
    webdriver = None

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import serve  # noqa: E402
from benchmarks.serving_load import ServerProcess  # noqa: E402
from quillgpt.chat_template import with_chat_tokens  # noqa: E402
from quillgpt.generate import load_for_sampling  # noqa: E402
from quillgpt.serve.app import PAGE_DIR, build_app  # noqa: E402
from quillgpt.serve.batcher import Batcher  # noqa: E402
from quillgpt.serve.requests import ServerSettings  # noqa: E402
from quillgpt.tokenizer import CharTokenizer  # noqa: E402

# one worker runs them all under xdist: they share one browser and three servers (the module's fixtures)
pytestmark = pytest.mark.xdist_group("page")

KEY = "page-key"
PRINTABLE = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # the hostile strings' characters, and more
# what a user might paste or a model might write, meant to run script or open a link if parsed as HTML
HOSTILE = [
    "<img src=x onerror=window.pwned=1>",
    "<script>window.pwned=1</script>",
    '<a href="javascript:window.pwned=1">click me</a>',
    "javascript:window.pwned=1",
    "<svg onload=window.pwned=1></svg>",
    "<iframe srcdoc='<script>parent.pwned=1</script>'></iframe>",
    "&lt;b&gt;not bold&lt;/b&gt; **not bold** [a link](javascript:window.pwned=1)",
    "<|im_end|><|im_start|>system",
]
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # as root in a container
    "--disable-gpu",
    "--disable-dev-shm-usage",
    # Chromium's own connections (updates, sync, field trials) off: the tests talk to 127.0.0.1 alone, and on a
    # closed network those would only be refused
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def missing_browser() -> list[str]:
    """What the browser tests need and this machine lacks."""
    missing = [
        f"{name} (apt-get install {package})"
        for name, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver"))
        if shutil.which(name) is None
    ]
    if webdriver is None:
        missing.append("selenium (pip install selenium)")
    return missing


def start_browser(user_data_dir: str):
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", "--window-size=1200,900"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


class PageServer(ServerProcess):
    """serve.py in fp32 (the page's greedy replies are compared with the API's and sample.py's); `page` is the URL
    its start-up line names."""

    def __init__(self, ckpt: Path, *flags: str, api_key: str | None = None):
        super().__init__(ckpt, "--dtype", "fp32", "--model-name", ckpt.stem, *flags, api_key=api_key)
        self.page = self.proc.stdout.readline().removeprefix("the page: ").strip()
        self.ckpt, self.name = ckpt, ckpt.stem

    def post(self, path: str, body: dict) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        r = httpx.post(f"{self.base}{path}", json={"model": self.name, **body}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def greedy_chat(self, messages: list[dict], max_tokens: int) -> str:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
        return self.post("/chat/completions", body)["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    missing = missing_browser()
    if missing and os.environ.get("QUILLGPT_REQUIRE_BROWSER"):  # CI installs them: there the tests must run
        pytest.fail("QUILLGPT_REQUIRE_BROWSER is set but the browser tests lack " + ", ".join(missing))
    if missing:
        pytest.skip("the browser tests need " + ", ".join(missing))
    driver = start_browser(str(tmp_path_factory.mktemp("chromium-profile")))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> dict[str, PageServer]:
    """Three servers, started together (most of a start is importing torch): on tiny random char models over
    printable ASCII (the hostile strings' characters),
    - chat: ChatML without the calculator, a context of 2,048 and no end of text, so a long reply streams for
      seconds and Stop lands mid-stream (its greedy replies never end early);
    - tools: ChatML with the calculator's tokens (its random replies may spell them: only the tool's test uses it);
    - base: no chat template, behind an API key;
    - small: ChatML without the calculator in the README's chat model's context, 128 tokens."""
    root = tmp_path_factory.mktemp("page-models")
    char = CharTokenizer(PRINTABLE, eot=False)
    models = {  # name: (tokenizer, the model's arguments, serve.py's flags)
        "chat": (chatml_without_tool(char), {"block_size": 2048}, ("--max-batch", "2")),
        "tools": (with_chat_tokens(char), {"block_size": 1024}, ()),
        "base": (char, {}, ()),
        "small": (chatml_without_tool(char), {"block_size": 128}, ()),
    }

    # written one after another: the random weights come from torch's one global generator, which threads would share
    ckpts = {
        name: write_checkpoint(root / f"{name}.pt", tokenizer=tok, **args) for name, (tok, args, _) in models.items()
    }

    def start(name: str) -> PageServer:
        return PageServer(ckpts[name], *models[name][2], api_key=KEY if name == "base" else None)

    with ThreadPoolExecutor(len(models)) as pool:
        futures = {name: pool.submit(start, name) for name in models}
    try:
        yield {name: future.result() for name, future in futures.items()}
    finally:
        for future in futures.values():
            if future.exception() is None:
                future.result().close()


@pytest.fixture(scope="module")
def chat_server(servers) -> PageServer:
    return servers["chat"]


@pytest.fixture(scope="module")
def tool_server(servers) -> PageServer:
    return servers["tools"]


@pytest.fixture(scope="module")
def base_server(servers) -> PageServer:
    return servers["base"]


@pytest.fixture(scope="module")
def small_server(servers) -> PageServer:
    return servers["small"]


class Page:
    """The browser on one of the servers' pages, with what a person does there."""

    def __init__(self, driver):
        self.driver = driver
        self.allowed_console = []  # patterns of console errors a test causes on purpose (a refused key's 401)

    def open(self, server: PageServer) -> None:
        """The page with nothing remembered: no conversation, setting or key from an earlier test."""
        self.driver.get(server.page)
        self.driver.execute_script("localStorage.clear(); sessionStorage.clear()")
        self.driver.refresh()
        self.wait(lambda: self.text("#model-info") != "connecting…")

    def wait(self, condition, timeout: float = 30):
        return WebDriverWait(self.driver, timeout, poll_frequency=0.02).until(lambda _: condition())

    def find(self, css: str):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def texts(self, css: str) -> list[str]:
        """The textContent of every match (selenium's .text would fold whitespace)."""
        return self.driver.execute_script(
            "return [...document.querySelectorAll(arguments[0])].map((e) => e.textContent)", css
        )

    def text(self, css: str) -> str:
        return self.find(css).get_property("textContent")

    def type_into(self, css: str, text: str) -> None:
        field = self.find(css)
        field.clear()
        field.send_keys(text)

    def settings(self, **values) -> None:
        for name, value in values.items():
            self.type_into(f"#{name}", str(value))

    def send(self, message: str) -> None:
        self.find("#message").send_keys(message + Keys.ENTER)

    def reply(self) -> str:
        """The last reply, once it has ended (its stats are shown)."""
        self.wait(lambda: self.texts(".message.assistant:last-child .stats"))
        return self.texts(".message.assistant .content")[-1]

    def messages(self) -> list[tuple[str, str]]:
        roles = self.driver.execute_script(
            "return [...document.querySelectorAll('#messages .message')].map((e) => e.classList[1])"
        )
        return list(zip(roles, self.texts("#messages .message .content")))

    def viewport(self, width: int, height: int, phone: bool = False) -> None:
        """The page's size, as DevTools' device mode sets it (a headless window is at least 500 pixels wide)."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": phone}
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)

    def reset_viewport(self) -> None:
        self.driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})

    def click(self, css: str) -> None:
        self.find(css).click()

    def pwned(self) -> bool:
        return self.driver.execute_script("return window.pwned !== undefined || window.parent.pwned !== undefined")

    def console_errors(self) -> list[str]:
        return [
            e["message"]
            for e in self.driver.get_log("browser")
            if e["level"] == "SEVERE" and not any(re.search(p, e["message"]) for p in self.allowed_console)
        ]


@pytest.fixture
def page(browser):
    """The shared browser; after each test, its console holds no error (a failed request, a CSP violation, a
    script error) but those the test allowed."""
    browser.get_log("browser")  # what an earlier test left
    p = Page(browser)
    yield p
    assert p.console_errors() == []


# ---- chat ------------------------------------------------------------------------------------------------------


def test_a_message_sent_with_enter_streams_the_apis_greedy_reply(page, chat_server):
    assert chat_server.page == chat_server.root + "/"  # as serve.py's start-up line names it
    page.open(chat_server)
    assert page.text("#model-info") == "chat · 2048 tokens of context"
    page.settings(temperature=0, max_tokens=12)
    page.send("hello there")
    first = page.reply()
    conversation = [{"role": "user", "content": "hello there"}]
    assert first == chat_server.greedy_chat(conversation, 12) and first
    assert re.fullmatch(r"12 tokens · [\d.]+ tokens/s · max tokens reached", page.texts(".message .stats")[-1])

    grant = {"origin": chat_server.root, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]}
    page.driver.execute_cdp_cmd("Browser.grantPermissions", grant)
    page.click(".copy")  # and paste it into the message box
    page.wait(lambda: page.text(".copy") == "Copied")
    page.find("#message").send_keys(Keys.CONTROL, "v")
    assert page.find("#message").get_property("value") == first
    page.find("#message").clear()

    page.click(".regenerate")  # greedy: the same reply again, in its place
    assert page.reply() == first and len(page.messages()) == 2

    page.click(".edit-button")  # edit the last message and send it again: the reply is the new message's
    page.type_into(".edit textarea", "goodbye")
    page.click(".edit .primary")
    second = page.reply()
    conversation = [{"role": "user", "content": "goodbye"}]
    assert page.messages() == [("user", "goodbye"), ("assistant", second)]
    assert second == chat_server.greedy_chat(conversation, 12)

    page.click("#system-box summary")  # a system prompt goes first, and the whole conversation is sent
    page.type_into("#system", "be brief.")
    page.send("and again?")
    conversation = [{"role": "system", "content": "be brief."}, *conversation, {"role": "assistant", "content": second}]
    assert page.reply() == chat_server.greedy_chat([*conversation, {"role": "user", "content": "and again?"}], 12)


QUESTIONS = ["What do you get from 32 + 36?", "Write house backwards.", "How many letters in strawberry?", "And 7 * 8?"]


def test_a_conversation_longer_than_the_context_goes_on_for_ten_turns_its_oldest_turns_left_out(page, small_server):
    """The README's chat model has 128 tokens of context: after a turn or two the conversation outgrows it. The page
    leaves its oldest turns out (shown greyed, under a line saying so, the system message kept), fits each reply to
    the room left, and every one of ten turns gets the API's greedy reply to what the page sent: no refusal."""
    page.open(small_server)
    page.settings(temperature=0)  # max tokens: the page's default, 64 for this context
    page.click("#system-box summary")
    page.type_into("#system", "be brief.")
    history: list[dict] = []
    for turn in range(10):
        question = QUESTIONS[turn % len(QUESTIONS)]
        page.send(question)
        reply = page.reply()
        assert not page.find("#error").is_displayed(), page.text("#error-text")
        history.append({"role": "user", "content": question})
        kept, max_tokens = fitted(small_server, history, "be brief.", setting=64)
        assert reply == small_server.greedy_chat(kept, max_tokens), turn
        history.append({"role": "assistant", "content": reply})
    outside = len(page.driver.find_elements(By.CSS_SELECTOR, "#messages .message.outside"))
    assert outside >= 2 and len(page.messages()) == 20
    assert page.text(".context-note").startswith(f"The model no longer sees the {outside} messages above")


def fitted(server: PageServer, history: list[dict], system: str, setting: int) -> tuple[list[dict], int]:
    """What the page sends, by chat.py's rule: the oldest turns out while the reply's room is under the smaller of
    max tokens and a quarter of the context; max_tokens then the room left."""
    needed = min(setting, 128 // 4)
    starts = [i for i, m in enumerate(history) if m["role"] == "user"]
    for turn, first in enumerate(starts):
        messages = [{"role": "system", "content": system}, *history[first:]]
        r = httpx.post(f"{server.root}/tokenize", json={"model": server.name, "messages": messages}, timeout=60)
        room = 128 - r.json()["count"]
        if room >= needed or turn == len(starts) - 1:
            return messages, min(setting, room)
    raise AssertionError("no user message")


def test_stop_ends_a_long_reply_and_the_server_frees_its_slot_within_a_second(page, chat_server):
    page.open(chat_server)
    page.settings(temperature=0, max_tokens=1500)
    page.send("tell me a long story")
    page.wait(lambda: len((page.texts(".message.assistant .content") or [""])[-1]) > 5)  # before its bubble: none
    assert chat_server.health()["active"] == 1  # mid-stream: the reply holds a slot
    page.click("#stop")
    stopped = time.monotonic()
    while chat_server.health() != {"status": "ok", "active": 0, "queued": 0}:
        assert time.monotonic() - stopped < 1.0, "the server still decodes the stopped reply"
        time.sleep(0.01)
    partial = page.reply()
    assert page.texts(".message .stats")[-1].endswith("· stopped") and partial
    page.settings(max_tokens=10)  # and the page talks again
    page.send("a short one")
    assert page.reply() == chat_server.greedy_chat(
        [
            {"role": "user", "content": "tell me a long story"},
            {"role": "assistant", "content": partial},
            {"role": "user", "content": "a short one"},
        ],
        10,
    )


def test_a_reload_keeps_the_conversations_which_can_be_switched_and_deleted(page, chat_server):
    page.open(chat_server)
    page.settings(temperature=0, max_tokens=8)
    page.send("first")
    page.reply()
    first = page.messages()
    page.click("#new-chat")
    assert page.messages() == []
    page.send("second")
    page.reply()
    second = page.messages()

    page.driver.refresh()
    page.wait(lambda: page.messages() == second)
    assert page.texts("#conversations .open") == ["second", "first"]
    page.click("#conversations li:nth-child(2) .open")
    assert page.messages() == first
    page.click("#conversations li:nth-child(1) .delete")  # "second"
    assert page.texts("#conversations .open") == ["first"] and page.messages() == first
    page.driver.refresh()
    page.wait(lambda: page.messages() == first)
    assert page.texts("#conversations .open") == ["first"]


def no_markup_and_nothing_ran(page: Page) -> bool:
    """No element a hostile string would make exists (the page has none of its own), and its global is unset."""
    counts = page.driver.execute_script(
        "return ['img', 'script:not([src])', 'a', 'svg', 'iframe', 'b'].map((t) => document.querySelectorAll(t).length)"
    )
    return counts == [0] * 6 and not page.pwned()


def test_hostile_text_in_a_message_or_a_prompt_is_shown_as_text_and_runs_nothing(page, chat_server):
    hostile = " ".join(HOSTILE)
    page.open(chat_server)
    page.settings(temperature=0, max_tokens=4)
    page.send(hostile)
    page.reply()
    assert page.messages()[0] == ("user", hostile)
    assert page.texts("#conversations .open") == [hostile[:60]]  # the title, from the first message
    page.click(".message.user .content")  # a "link" there is text: nothing to follow
    page.driver.refresh()  # and as stored
    page.wait(lambda: page.messages() and page.messages()[0] == ("user", hostile))
    assert no_markup_and_nothing_ran(page)

    page.click("#mode-completion")  # a chat model, on request: completion, with the hostile prompt
    page.type_into("#prompt", hostile)
    page.click("#generate")
    page.wait(lambda: page.text("#completion-stats"))
    assert page.text("#completion-prompt") == hostile and no_markup_and_nothing_ran(page)
    page.click("#mode-chat")  # the next visit starts in chat again


def test_a_calculator_call_is_folded_and_goes_back_to_the_server_as_parts(page, tool_server):
    """A reply that spells markup and calls the calculator (stored, as a reply streamed earlier would be): its text
    is text, the call is folded, and the next request sends it as parts, so the tool's tokens are tokens again."""
    page.open(tool_server)
    page.settings(temperature=0, max_tokens=4)
    reply = "".join(HOSTILE[:2]) + "<|python_start|>32+36<|python_end|><|output_start|>68<|output_end|>68"
    conversation = [{"role": "user", "content": "what is 32+36?"}, {"role": "assistant", "content": reply}]
    page.driver.execute_script(
        """localStorage.setItem('quillgpt.page.conversations', JSON.stringify({c: {id: 'c', title: 't', system: '',
        messages: arguments[0], updated: 1}}));
        localStorage.setItem('quillgpt.page.current', 'c');""",
        conversation,
    )
    page.driver.refresh()
    page.wait(lambda: len(page.messages()) == 2)
    assert page.messages()[1] == ("assistant", "".join(HOSTILE[:2]) + "calculator: 32+36 → 6868")
    assert page.texts(".tool") == ["calculator: 32+36 → 68"] and not page.find(".tool .call").is_displayed()
    page.click(".tool .tool-name")  # unfolded
    assert page.find(".tool .call").is_displayed() and no_markup_and_nothing_ran(page)

    page.driver.execute_script(  # what the page sends, as the server receives it
        """window.sent = [];
        const fetch = window.fetch;
        window.fetch = (url, init) => (window.sent.push(init && init.body), fetch(url, init));"""
    )
    page.send("thanks")
    page.reply()
    sent = json.loads(page.driver.execute_script("return window.sent[0]"))["messages"]
    parts = [("text", "".join(HOSTILE[:2])), ("python", "32+36"), ("python_output", "68"), ("text", "68")]
    assert [(p["type"], p["text"]) for p in sent[1]["content"]] == parts
    streamed = page.driver.execute_script(
        "return JSON.parse(localStorage.getItem('quillgpt.page.conversations')).c.messages[3].content"
    )
    assert streamed == tool_server.greedy_chat(sent, 4)  # as streamed: a random reply may spell the tool's tokens


# ---- completion and the API key ---------------------------------------------------------------------------------


def give_key(page: Page, key: str) -> None:
    page.type_into("#api-key", key)
    page.click("#use-key")


def test_with_an_api_key_the_page_asks_for_it_before_it_talks_and_keeps_it_in_the_tab(page, base_server):
    page.open(base_server)
    assert page.find("#key-box").is_displayed() and page.text("#model-info") == "no API key"
    assert not page.find("#generate").is_enabled()
    page.allowed_console.append(r"/v1/models - Failed to load resource: the server responded with a status of 401")
    give_key(page, "wrong")
    page.wait(lambda: "the server refused the API key" in page.text("#error-text"))
    assert page.find("#key-box").is_displayed() and not page.find("#generate").is_enabled()
    give_key(page, KEY)
    page.wait(lambda: page.text("#model-info") == "base · 96 tokens of context")
    assert not page.find("#key-box").is_displayed() and page.find("#generate").is_enabled()
    page.settings(max_tokens=5)
    page.click("#generate")
    page.wait(lambda: page.text("#completion-stats"))
    assert len(page.text("#completion-text")) == 5
    stored = page.driver.execute_script("return [JSON.stringify(localStorage), JSON.stringify(sessionStorage)]")
    assert KEY not in stored[0] and KEY in stored[1]


def test_completion_mode_on_a_base_model_continues_the_prompt_as_sample_py_does(page, base_server):
    prompt = "the king "
    sample_py = subprocess.Popen(  # started first: its start-up overlaps the page's work
        [sys.executable, "sample.py", "--ckpt", str(base_server.ckpt), "--prompt", prompt, "--max-new-tokens", "40"]
        + ["--temperature", "0", "--seed", "7", "--dtype", "fp32", "--no-stream"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    page.open(base_server)
    give_key(page, KEY)
    page.wait(lambda: page.find("#generate").is_enabled())
    assert not page.find("#mode-chat").is_enabled()  # no chat template: completion only
    page.settings(temperature=0, max_tokens=40, seed=7)
    page.type_into("#prompt", prompt)
    page.click("#generate")
    page.wait(lambda: page.text("#completion-stats"))
    out, err = sample_py.communicate(timeout=120)
    assert sample_py.returncode == 0, err
    assert page.text("#completion-prompt") + page.text("#completion-text") + "\n" == out
    assert re.fullmatch(r"40 tokens · [\d.]+ tokens/s · max tokens reached", page.text("#completion-stats"))


def test_a_refusal_from_the_server_is_shown_in_the_page(page, base_server):
    page.open(base_server)
    give_key(page, KEY)
    page.wait(lambda: page.find("#generate").is_enabled())
    page.allowed_console.append(r"/v1/completions - Failed to load resource: the server responded with a status of 400")
    page.settings(max_tokens=500)
    page.click("#generate")
    page.wait(lambda: page.find("#error").is_displayed())
    assert "400: max_tokens is 500" in page.text("#error-text") and "96-token context" in page.text("#error-text")


def test_at_a_phones_width_the_page_fits_and_chats(page, chat_server):
    page.viewport(390, 844, phone=True)
    try:
        page.open(chat_server)
        assert page.driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        assert not page.find("#settings").is_displayed() and not page.find("#sidebar").is_displayed()
        page.click("#toggle-settings")  # the side panels open from the header
        page.settings(temperature=0, max_tokens=5)
        page.click("#toggle-settings")
        page.send("hi")
        assert page.reply() == chat_server.greedy_chat([{"role": "user", "content": "hi"}], 5)
        send = page.find("#send").rect
        assert send["x"] + send["width"] <= 390 and page.find("#send").is_displayed()
    finally:
        page.reset_viewport()


def test_a_screenshot_of_a_conversation(page, chat_server, tmp_path):
    """The README's picture (QUILLGPT_PAGE_SCREENSHOT=docs/chat_page.png writes it there), 900x700, with the first
    calculator call opened where the model makes one."""
    ckpt = os.environ.get("QUILLGPT_PAGE_SCREENSHOT_CKPT")
    server = PageServer(Path(ckpt)) if ckpt else chat_server
    page.viewport(900, 700)
    try:
        page.open(server)
        page.settings(temperature=0, max_tokens=20)
        for question in ("What do you get from 32 + 36?", "Write house backwards."):  # base-chat: 128 tokens
            page.send(question)
            page.reply()
        if page.texts(".tool"):
            page.click(".tool .tool-name")
        shot = tmp_path / "chat_page.png"
        page.driver.save_screenshot(str(shot))
    finally:
        page.reset_viewport()
        if ckpt:
            server.close()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("QUILLGPT_PAGE_SCREENSHOT"):
        shutil.copy(shot, REPO_ROOT / os.environ["QUILLGPT_PAGE_SCREENSHOT"])


# ---- without a browser: the headers, the script, --no-page ------------------------------------------------------


def test_the_page_and_its_files_need_no_key_and_carry_a_content_security_policy(base_server):
    for path in ("/", "/page/page.js", "/page/page.css", "/page/server.json"):
        r = httpx.get(base_server.root + path)
        assert r.status_code == 200, path
        assert r.headers["content-security-policy"] == CSP and r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(base_server.root + "/page/server.json").json() == {"api_key_required": True}
    assert httpx.get(f"{base_server.base}/models").status_code == 401  # the API stays behind the key


def test_the_pages_script_never_turns_text_into_html():
    """Text reaches the page through textContent and text nodes only: none of the calls that parse HTML or run
    strings as code appear in page.js (the CSP would refuse the last two anyway)."""
    source = re.sub(r"^\s*//.*$", "", (PAGE_DIR / "page.js").read_text(), flags=re.M)  # comments may name them
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "Function("):
        assert sink not in source, sink


def test_no_page_serves_the_api_alone(tmp_path):
    from fastapi.testclient import TestClient

    model, tokenizer, _ = load_for_sampling(write_checkpoint(tmp_path / "tiny.pt"), "cpu", "fp32")
    for page, status in ((True, 200), (False, 404)):
        client = TestClient(build_app(Batcher(model, tokenizer, 1, 0), ServerSettings("tiny", 96), page=page))
        assert [client.get(path).status_code for path in ("/", "/page/page.js", "/page/server.json")] == [status] * 3
        card = client.get("/v1/models").json()["data"][0]
        fields = {"id": "tiny", "object": "model", "context_length": 96, "chat": True, "tools": []}
        assert {name: card[name] for name in fields} == fields
    assert serve.parse_args(["--ckpt", "x", "--no-page"]).no_page

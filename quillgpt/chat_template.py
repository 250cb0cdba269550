"""Conversations -> token ids: chat templates rendered in a sandbox, as transformers renders them.

A conversation is a list of messages {"role": "system" | "user" | "assistant", "content": str}. A tokenizer's
chat template (Jinja source: a Hugging Face tokenizer's own `chat_template`, or the built-in ChatML one that
with_chat_tokens gives our char, bpe and tiktoken tokenizers) renders it to text, which is tokenized with special
tokens recognised, exactly as transformers' `apply_chat_template(messages, tokenize=True)` does.

The template runs in Jinja's immutable sandbox with the globals transformers gives it (raise_exception,
strftime_now, a tojson that does not escape HTML): it can read the messages and nothing else: no attribute of
Python internals, no file, no import.

A message's content is text: where it spells a control token (`<|im_end|>`, `<|eot_id|>`, ...), it is encoded as
that text, not as the token, so that a message can't end its turn and forge another (a server's client, a user of
chat.py, a record of chat data). The template's own control tokens are found by rendering the messages with each
such spelling replaced by a stand-in character (a Unicode noncharacter or private-use character found nowhere in the
conversation or the template), which the tokenizer encodes as the text it stands for (Tokenizer.encode_chat); where
no content spells one, the ids are exactly transformers'. control_tokens_in_content=True gives transformers' default
instead: content that spells a control token gets the token.

Which tokens are the assistant's (the loss mask of chat fine-tuning) is found by rendering: the text an assistant
message adds to the conversation before it (rendered with the generation prompt) is that message's span, up to and
including the first special token after its content (its end-of-turn token). A token counts as the assistant's when
it overlaps a span (transformers' rule for `return_assistant_tokens_mask`), and works for any template, with or
without `{% generation %}` markers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from quillgpt.errors import UserError
from quillgpt.tokenizer import Tokenizer, special_pattern, tokenizer_from_dict

ROLES = ("system", "user", "assistant")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
# the calculator tool's tokens (quillgpt/tools.py), added after the chat tokens: a call and its output
TOOL_TOKENS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")
# an assistant message that used the tool has a list of parts as content, each {"type": one of these, "text": str},
# rendered as the text between the tool tokens of its type (nanochat's form): a text, a call, a call's output
PART_TYPES = {"text": ("", ""), "python": TOOL_TOKENS[:2], "python_output": TOOL_TOKENS[2:]}
# ChatML (OpenAI's, used by Qwen and SmolLM2): llama.cpp, Ollama and transformers all know it. A message whose content
# is a string renders exactly as in plain ChatML; a list of parts renders each between its tool tokens
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'python' %}{{ '<|python_start|>' + part['text'] + '<|python_end|>' }}"
    "{% elif part['type'] == 'python_output' %}{{ '<|output_start|>' + part['text'] + '<|output_end|>' }}"
    "{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# tokenizer_config.json keys whose strings a template may use (transformers passes its special_tokens_map)
TEMPLATE_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
# characters that stand in for a control token a message spells: Unicode's noncharacters (set aside for a program's
# own use, never in interchanged text), then plane 15's private-use characters
STAND_IN_CODEPOINTS = (range(0xFDD0, 0xFDF0), range(0xF0000, 0xFFFFE))


def check_messages(messages: Any, where: str, need_assistant: bool = False) -> list[dict]:
    """A conversation as a list of {"role", "content"} dicts with known roles and string content; UserError (one
    line starting with `where`) otherwise."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"{where}: message {i} is not an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            got = "no role" if role is None else f"role {role!r}"
            raise UserError(f"{where}: message {i} has {got}; roles are {', '.join(ROLES)}")
        if role == "assistant" and isinstance(content, list):
            content = check_parts(content, f"{where}: message {i} (assistant)")
        elif not isinstance(content, str):
            raise UserError(f"{where}: message {i} ({role}) has content of type {type(content).__name__}, not a string")
        checked.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in checked):
        raise UserError(f"{where}: the conversation has no assistant message (nothing to learn from)")
    return checked


def check_parts(parts: list, where: str) -> list[dict]:
    """An assistant message's parts (it used the calculator tool): {"type": text | python | python_output, "text": str}
    each; UserError otherwise."""
    if not parts:
        raise UserError(f"{where}: content is an empty list of parts")
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in PART_TYPES or not isinstance(part.get("text"), str):
            raise UserError(f'{where}: part {j} is not {{"type": {" | ".join(PART_TYPES)}, "text": a string}}')
    return [{"type": p["type"], "text": p["text"]} for p in parts]


def content_texts(content: str | list[dict]) -> list[str]:
    """The texts a message's content holds: the string, or each part's text."""
    return [content] if isinstance(content, str) else [p["text"] for p in content]


def content_rendered(content: str | list[dict]) -> str:
    """A message's content as the built-in ChatML renders it (parts between their tool tokens)."""
    if isinstance(content, str):
        return content
    return "".join(PART_TYPES[p["type"]][0] + p["text"] + PART_TYPES[p["type"]][1] for p in content)


# ---- the sandbox ------------------------------------------------------------------------------------


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str):
    """Jinja source -> a template in the immutable sandbox (transformers' settings); UserError when it won't parse."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise UserError("chat templates need jinja2: pip install jinja2") from None

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} (transformers' assistant markers) renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise UserError(f"chat template does not parse: {e}") from None


def render(source: str, messages: list[dict], add_generation_prompt: bool, variables: dict[str, str]) -> str:
    import jinja2

    template = compile_template(source)
    try:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.SecurityError as e:
        raise UserError(f"chat template tried something the sandbox forbids: {e}") from None
    except jinja2.TemplateError as e:
        raise UserError(f"chat template: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise UserError(f"chat template failed on this conversation: {type(e).__name__}: {e}") from None


# ---- tokenizers --------------------------------------------------------------------------------------


def template_variables(tokenizer: Tokenizer) -> dict[str, str]:
    """The special-token strings a template may use: an hf tokenizer's from its tokenizer_config.json."""
    config = getattr(tokenizer, "config", {}) or {}
    out = {}
    for key in TEMPLATE_TOKEN_KEYS:
        value = config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[key] = value
    return out


def with_chat_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer ready for conversations: unchanged when it has a chat template; otherwise the ChatML template
    with <|im_start|> and <|im_end|> added to its vocabulary (after its last id; an hf tokenizer that has them
    already keeps their ids), then the calculator tool's four (TOOL_TOKENS)."""
    if tokenizer.chat_template:
        return tokenizer
    d = tokenizer.to_dict()
    d.pop("vocab_size", None)
    if d["kind"] == "hf":
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as RustTokenizer

        hf = RustTokenizer.from_str(d["tokenizer_json"])
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS + TOOL_TOKENS])
        d["tokenizer_json"] = hf.to_str()
        d["tokenizer_config"] = {**d.get("tokenizer_config", {}), "chat_template": CHATML_TEMPLATE}
    else:
        d.update(chat_tokens=list(CHAT_TOKENS + TOOL_TOKENS), chat_template=CHATML_TEMPLATE)
    return tokenizer_from_dict(d)


def stand_ins(taken: str) -> Iterator[str]:
    """Characters to stand in for control tokens, none of them in `taken`."""
    return (chr(c) for block in STAND_IN_CODEPOINTS for c in block if chr(c) not in taken)


class ChatFormat:
    """A tokenizer's chat template: conversations -> prompt ids, or ids with the assistant-token mask. A message's
    content that spells a control token is encoded as text (the module docstring), unless control_tokens_in_content
    (transformers' default: it becomes the token)."""

    def __init__(self, tokenizer: Tokenizer, control_tokens_in_content: bool = False):
        if not tokenizer.chat_template:
            raise UserError(
                "this tokenizer has no chat template: fine-tune on chat data first (prepare.py --chat), "
                "or use a model whose tokenizer_config.json has a chat_template"
            )
        self.tokenizer = tokenizer
        self.template = tokenizer.chat_template
        self.variables = template_variables(tokenizer)
        self.control_tokens_in_content = control_tokens_in_content
        specials = tokenizer.special_tokens
        self.control = re.compile(special_pattern(specials)) if specials and not control_tokens_in_content else None
        # the calculator tool (quillgpt/tools.py): the tokenizer has its tokens and the template renders them
        self.tools = all(t in specials and t in self.template for t in TOOL_TOKENS)
        compile_template(self.template)
        end = self.end_of_turn(PROBE)
        self.stop_ids = frozenset({tokenizer.special_tokens[end]} if end else set()) | frozenset(
            {tokenizer.eot_id} if tokenizer.eot_id is not None else set()
        )
        if not self.stop_ids:
            raise UserError("the chat template ends an assistant turn with no special token, so a reply can't stop")

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return render(self.template, list(messages), add_generation_prompt, self.variables)

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The conversation so far, ending with the header the assistant's reply follows."""
        rendered, literals = self.literal_content(messages)
        return self.tokenizer.encode_chat(self.render(rendered, add_generation_prompt=True), literals)[0]

    def literal_content(self, messages: Sequence[dict]) -> tuple[list[dict], dict[str, str]]:
        """(the messages to render, what each stand-in stands for): every control token a message's content spells
        replaced by a stand-in character, which encode_chat spells out again as text. Unchanged when no content
        spells one, or with control_tokens_in_content."""
        messages = list(messages)
        if not self.tools and any(not isinstance(m["content"], str) for m in messages):
            raise UserError(
                "a message uses the calculator tool (content as parts), and this chat template has no tool tokens"
            )
        texts = [text for m in messages for text in content_texts(m["content"])]
        spelled = sorted({t for text in texts for t in self.control.findall(text)}) if self.control else []
        if not spelled:
            return messages, {}
        taken = self.template + "".join(self.variables.values()) + "".join(texts)
        literals = dict(zip(stand_ins(taken), spelled))
        stand_in = {token: c for c, token in literals.items()}

        def escaped(content: str | list[dict]) -> str | list[dict]:
            if not isinstance(content, str):
                return [{**p, "text": escaped(p["text"])} for p in content]
            return self.control.sub(lambda spelling: stand_in[spelling[0]], content)

        return [{**m, "content": escaped(m["content"])} for m in messages], literals

    def assistant_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character span of each assistant message in it (its end-of-turn
        token included). The messages are rendered as given: encode renders literal_content's."""
        full = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            through = self.render(messages[: i + 1])
            if not (through.startswith(before) and full.startswith(through)):
                raise UserError(
                    "the chat template does not render a conversation as the sum of its turns, so the assistant's "
                    "tokens can't be found"
                )
            turn = through[len(before) :]
            end = self._turn_end(turn, m["content"])
            spans.append((len(before), len(before) + end))
        return full, spans

    def encode(self, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
        """(ids, mask): mask is 1 on the tokens of assistant messages, their end-of-turn token included, except a
        tool call's output (<|output_start|> through <|output_end|>): the sampler inserts it, the model never
        predicts it."""
        rendered, literals = self.literal_content(messages)
        full, spans = self.assistant_spans(rendered)
        ids, starts = self.tokenizer.encode_chat(full, literals)
        outputs = self.tool_output_spans(full)
        assistant, inserted = overlapping(starts, len(full), spans), overlapping(starts, len(full), outputs)
        mask = [int(a and not o) for a, o in zip(assistant, inserted)]
        return ids, mask

    def tool_output_spans(self, full: str) -> list[tuple[int, int]]:
        """The character spans of the tool's outputs in a rendered conversation, their two tokens included (content
        that spells a tool token is a stand-in character by now: every one found is the template's)."""
        if not self.tools:
            return []
        start, end = re.escape(TOOL_TOKENS[2]), re.escape(TOOL_TOKENS[3])
        return [m.span() for m in re.finditer(f"{start}.*?{end}", full, flags=re.DOTALL)]

    def _turn_end(self, turn: str, content: str | list[dict]) -> int:
        """Where an assistant turn's text ends: after the first special token past its content, else its end."""
        content = content_rendered(content)
        after = turn.find(content) + len(content) if content and content in turn else 0
        hits = [(turn.find(t, after), t) for t in self.tokenizer.special_tokens if turn.find(t, after) >= 0]
        if not hits:
            return len(turn)
        at, token = min(hits)
        return at + len(token)

    def end_of_turn(self, messages: Sequence[dict]) -> str | None:
        """The special token that ends an assistant turn in this template (None when it ends with none)."""
        full, spans = self.assistant_spans(check_messages(list(messages), "probe"))
        a, b = spans[-1]
        tail = full[a:b]
        return next((t for t in self.tokenizer.special_tokens if tail.endswith(t)), None)


def chat_format(tokenizer: Tokenizer, control_tokens_in_content: bool = False) -> ChatFormat:
    return ChatFormat(tokenizer, control_tokens_in_content)


def overlapping(starts: list[int], length: int, spans: list[tuple[int, int]]) -> list[bool]:
    """Per token (its text from starts[i] to the next token's start, the last to length): whether it overlaps any of
    the character spans."""
    ends = starts[1:] + [length]
    return [any(s < b and e > a for a, b in spans) for s, e in zip(starts, ends)]


def common_prefix(a: list, b: list) -> int:
    """How many leading items a and b share (token ids: what two renderings of a conversation have in common)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

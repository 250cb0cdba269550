"""A multi-turn conversation with a model, its KV cache kept across turns. chat.py is the command line over it.

Each turn renders the whole conversation with the tokenizer's chat template (ChatFormat.prompt_ids), as a
re-encoding would, and runs through the model only the ids the cache doesn't hold yet: the cache holds the ids of
every turn so far, each reply's end-of-turn token included, so the next prompt starts with them. Where the rendering
differs from what the cache holds (a reply the tokenizer encodes differently from how it was sampled, a changed
system message), the cache is rewound to the longest common prefix; the positions after it are overwritten. The
new ids run in one forward pass appended to the cache (each sees the cache and the new ids before it).

When the reply would have less room than the smaller of its longest length and a quarter of the context, the oldest
turns are dropped (the system message kept), with a notice; a reply gets the room left.

A tokenizer with the calculator tool's tokens (quillgpt/tools.py) gets its calls answered: after the model writes
<|python_start|>expression<|python_end|>, the output (<|output_start|>42<|output_end|>) is put into the reply and
the cache, and sampling goes on after it; the reply's message holds its parts (text, python, python_output).
"""

from __future__ import annotations

import sys
from typing import TextIO

import torch

from model import GPT
from quillgpt.chat_template import ChatFormat, chat_format, common_prefix
from quillgpt.engine import Draws, Engine, Row, RowText, Sampling, showable_length
from quillgpt.errors import UserError
from quillgpt.tokenizer import Tokenizer
from quillgpt.tools import calculator_for, reply_parts


class ChatSession:
    def __init__(
        self,
        model: GPT,
        tokenizer: Tokenizer,
        system: str | None = None,
        max_new_tokens: int = 256,
        notices: TextIO | None = sys.stderr,
        control_tokens_in_content: bool = False,
        plan=None,
    ):
        """control_tokens_in_content: a message that spells a control token gets the token (transformers' default),
        not its text (quillgpt.chat_template). plan: the loaded model's decoding plan (generate.plan_decoding; None:
        eager); a compiled step is compiled, or loaded, for the whole context, which the conversation grows into,
        before the first message, where a failure ends the session at once."""
        self.model, self.tokenizer = model, tokenizer
        # a UserError when the tokenizer has no chat template
        self.format: ChatFormat = chat_format(tokenizer, control_tokens_in_content)
        self.calculator = calculator_for(tokenizer) if self.format.tools else None  # one Calculator per reply
        self.max_new_tokens = max_new_tokens
        self.notices = notices
        compiled = plan is not None and plan.step != "eager"
        length = self.block_size if compiled else 64
        self.engine = Engine(model, plan, capacity=1, length=length, vocab_size=tokenizer.vocab_size)
        self.system = system
        self.messages: list[dict] = []
        self.ids: list[int] = []  # the ids whose keys and values the cache holds, in order
        self.encoded = 0  # ids run through the model to read prompts (not to generate): what the cache saves
        self.reset(system)

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def reset(self, system: str | None = None) -> None:
        """A new conversation (with this system message, if any); the cache's memory is kept for it."""
        self.system = system or None
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids = []

    # ---- one turn ---------------------------------------------------------------------------------

    def reply(
        self,
        user_text: str,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        generator: torch.Generator | None = None,
        stream: TextIO | None = None,
        max_new_tokens: int | None = None,
    ) -> str:
        """The assistant's answer to user_text, streamed to `stream` as it is produced, ending at an end-of-turn id
        or after max_new_tokens (the tool's outputs count). Both messages join the conversation. The text returned
        spells the tool's tokens, where the reply used it (the message holds its parts)."""
        self.messages.append({"role": "user", "content": user_text})
        try:
            prompt, budget = self.fit(self.max_new_tokens if max_new_tokens is None else max_new_tokens)
        except UserError:
            self.messages.pop()
            raise
        row = Row(
            prompt,
            Sampling(temperature, top_k, top_p),
            budget,
            stop_ids=self.format.stop_ids,
            draws=Draws(generator),
            calculator=self.calculator() if self.calculator else None,
            text=RowText(self.tokenizer, prompt),
        )
        keep = min(common_prefix(self.ids, prompt), len(prompt) - 1)  # the last id must run: its logits are needed
        self.engine.extend(row, prompt[keep:], keep)
        self.encoded += len(prompt) - keep
        shown = 0
        while self.engine.rows:
            self.engine.step()
            if stream is not None:
                end = len(row.shown) if row.finish else showable_length(row.shown, ())
                stream.write(row.shown[shown:end])
                stream.flush()
                shown = max(shown, end)
        if row.new:  # the cache takes the reply's last id too (an end of turn: the next turn follows it)
            self.engine.extend(row, row.new[-1:], len(row.ids) - 1, room=0)
        self.ids = row.ids
        generated = [t for t in row.new if t not in self.format.stop_ids]
        text = row.shown if generated else ""
        if stream is not None:
            stream.write(text[shown:])
            stream.flush()
        parts = reply_parts(self.tokenizer, generated) if self.calculator else None
        self.messages.append({"role": "assistant", "content": parts or text})
        return text

    def fit(self, max_new_tokens: int) -> tuple[list[int], int]:
        """(prompt ids, reply budget): the oldest turns dropped while the reply would have less room than the smaller
        of max_new_tokens and a quarter of the context (serve.py's page fits a conversation alike), the budget the
        room left. A message that can't fit even alone is a UserError, the conversation untouched."""
        alone = self.format.prompt_ids([m for m in self.messages if m["role"] == "system"] + self.messages[-1:])
        if len(alone) >= self.block_size:
            raise UserError(
                f"this message makes a prompt of {len(alone)} tokens, and the model's context is {self.block_size}: "
                "say it in fewer words (or a shorter system message)"
            )
        dropped = 0
        while True:
            prompt = self.format.prompt_ids(self.messages)
            room = self.block_size - len(prompt)
            if room >= min(max_new_tokens, self.block_size // 4) or not self.drop_oldest_turn():
                break
            dropped += 1
        if dropped and self.notices is not None:
            print(
                f"[the conversation outgrew the context of {self.block_size} tokens: dropped the oldest "
                f"{dropped} turn{'s' if dropped > 1 else ''}]",
                file=self.notices,
            )
        return prompt, min(max_new_tokens, self.block_size - len(prompt))

    def drop_oldest_turn(self) -> bool:
        """Remove the first user message and the replies after it (never the system message, nor the message being
        answered); False when there is nothing left to drop."""
        turns = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if len(turns) < 2:
            return False
        del self.messages[turns[0] : turns[1]]
        return True

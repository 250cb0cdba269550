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

from model import GPT, KVCache, sample_next
from quillgpt.chat_template import ChatFormat, chat_format, common_prefix
from quillgpt.errors import UserError
from quillgpt.generate import showable_length
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
        compile: bool | None = False,
    ):
        """control_tokens_in_content: a message that spells a control token gets the token (transformers' default),
        not its text (quillgpt.chat_template). compile: decode with the compiled step (GPT.decoding_cache; None: one
        only where one is kept; True compiles it for the whole context, which the conversation grows into)."""
        self.model, self.tokenizer = model, tokenizer
        # a UserError when the tokenizer has no chat template
        self.format: ChatFormat = chat_format(tokenizer, control_tokens_in_content)
        self.calculator = calculator_for(tokenizer) if self.format.tools else None  # one Calculator per reply
        self.max_new_tokens = max_new_tokens
        self.notices = notices
        self.device = next(model.parameters()).device
        self.positions = torch.arange(model.config.block_size, device=self.device)  # a step's position, on the device
        self.system = system
        self.messages: list[dict] = []
        self.ids: list[int] = []  # the ids whose keys and values the cache holds, in order
        self.cache: KVCache | None = None
        self.compile = compile
        self.decode = model.decode_one  # the step for the cache (GPT.decoding_cache), chosen with each new cache
        self.encoded = 0  # ids run through the model to read prompts (not to generate): what the cache saves
        self.reset(system)
        if compile:  # compiled (or loaded) before the first message, where a failure ends the session at once
            self.ensure_room(self.block_size, 0)

    @property
    def block_size(self) -> int:
        return self.model.config.block_size

    def reset(self, system: str | None = None) -> None:
        """A new conversation (with this system message, if any); the cache's memory is kept for it."""
        self.system = system or None
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.ids = []

    # ---- one turn ---------------------------------------------------------------------------------

    @torch.inference_mode()
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
        logits = self.read(prompt, budget)
        stop = self.format.stop_ids
        generated: list[int] = []
        inserted: list[int] = []  # a tool call's output, put in after the call, before anything more is sampled
        calculator = self.calculator() if self.calculator else None
        shown = 0
        for _ in range(budget):
            token = inserted.pop(0) if inserted else self.sample(logits, temperature, top_k, top_p, generator)
            logits = self.step(token)  # the cache takes every token, an end of turn too: the next turn follows it
            if token in stop:
                break
            generated.append(token)
            if calculator is not None:
                inserted += calculator.after(token)
            if stream is not None:
                text = self.tokenizer.decode_after(prompt[-8:], generated)
                end = showable_length(text, [])
                stream.write(text[shown:end])
                stream.flush()
                shown = max(shown, end)
        text = self.tokenizer.decode_after(prompt[-8:], generated) if generated else ""
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

    # ---- the model and its cache --------------------------------------------------------------------

    def read(self, prompt: list[int], budget: int) -> torch.Tensor:
        """Bring the cache to hold `prompt`, running through the model only what it lacks; the next-token logits
        (1, V). Room is made for budget more tokens."""
        keep = min(common_prefix(self.ids, prompt), len(prompt) - 1)  # the last id must run: its logits are needed
        self.ensure_room(len(prompt) + budget, keep)
        self.cache.pos = keep
        new = torch.tensor([prompt[keep:]], device=self.device)  # (1, T)
        logits, _ = self.model(new, cache=self.cache, last_only=True)
        self.ids = list(prompt)
        self.encoded += len(prompt) - keep
        return logits[:, -1, :]

    def step(self, token: int) -> torch.Tensor:
        """Append one id to the cache; the logits (1, V) of the token after it."""
        position = self.positions[self.cache.pos : self.cache.pos + 1]  # (1,)
        logits = self.decode(torch.tensor([[token]], device=self.device), position, self.cache)
        self.cache.pos += 1
        self.ids.append(token)
        return logits

    def ensure_room(self, needed: int, keep: int) -> None:
        """A cache of at least `needed` positions, its first `keep` ones carried over from the old cache."""
        if self.cache is not None and self.cache.length >= needed:
            return
        old = self.cache
        # one compile for the whole conversation, not one for each length the cache grows through
        needed = self.block_size if self.compile else needed
        self.cache, self.decode = self.model.decoding_cache(1, needed, self.compile)
        if old is not None:
            for layer in range(len(old.k)):
                self.cache.k[layer][:, :, :keep] = old.k[layer][:, :, :keep]
                self.cache.v[layer][:, :, :keep] = old.v[layer][:, :, :keep]

    def sample(
        self,
        logits: torch.Tensor,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        generator: torch.Generator | None,
    ) -> int:
        logits = logits.float()
        if self.tokenizer.vocab_size < logits.size(-1):  # a vocabulary padded for speed: ids nothing decodes
            logits[:, self.tokenizer.vocab_size :] = -float("inf")
        return int(sample_next(logits, temperature, top_k, top_p, generator)[0, 0])

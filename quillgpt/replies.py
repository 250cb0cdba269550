"""Many chat replies decoded together, a row of one engine each (quillgpt/engine.py): RL's groups of sampled replies
(quillgpt/rl.py) and the greedy answers of an evaluation's chat tasks (quillgpt/evaluate.py). Each prompt is read
once for its group; calculator calls are answered as in chat.py (quillgpt/tools.py). A greedy reply here is the one
ChatSession.reply gives the same question alone (tests/test_chat.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from model import GPT
from quillgpt.chat_template import ChatFormat, chat_format
from quillgpt.engine import Draws, Engine, Row, Sampling, cache_length
from quillgpt.errors import UserError
from quillgpt.tokenizer import Tokenizer
from quillgpt.tools import answer_text, calculator_for, reply_parts

REPLY_CACHE_BYTES = 256 * 2**20  # one pass of batched chat answers: its rows' keys and values, at the length they need


@dataclass
class Reply:
    ids: list[int]  # sampled and inserted ids, the end-of-turn id included where the reply ended with it
    sampled: list[bool]  # per id: the model sampled it (False: a calculator output, inserted)
    text: str = ""  # the reply as ChatSession.reply returns it (the tool's tokens spelled out)
    answer: str = ""  # the text after the calculator's output (tools.answer_text)


def sample_groups(
    model: GPT,
    tokenizer: Tokenizer,
    fmt: ChatFormat,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
    plan=None,
) -> list[list[Reply]]:
    """group_size replies to each prompt, all decoded together: each step samples a token for every reply still
    going (temperature 0: the most likely one, else one number each from `generator`, the ended replies' too) or puts
    in the next id of a calculator output, until every reply has ended or taken max_new_tokens (fewer where its
    prompt leaves less of the context)."""
    block = model.config.block_size
    if max(map(len, prompts)) >= block:
        raise UserError(
            f"a prompt of {max(map(len, prompts))} tokens leaves no room for a reply in the context of {block}"
        )
    draws = Draws(generator, len(prompts) * group_size)
    new_calculator = calculator_for(tokenizer)
    rows = [
        Row(
            prompt,
            Sampling(temperature, top_k),
            min(max_new_tokens, block - len(prompt)),
            stop_ids=fmt.stop_ids,
            draws=draws,
            draw_index=p * group_size + j,
            calculator=new_calculator() if new_calculator else None,
        )
        for p, prompt in enumerate(prompts)
        for j in range(group_size)
    ]
    # a power of two, as a ChatSession's cache: few distinct sizes for the allocator to reuse, step after step
    length = cache_length(max(len(r.prompt) + r.max_new for r in rows), block)
    engine = Engine(model, plan, capacity=len(rows), length=length, vocab_size=tokenizer.vocab_size)
    engine.add(rows)
    while engine.rows:
        engine.step()
    replies = []
    for row in rows:
        kept = [t for t in row.new if t not in fmt.stop_ids]
        text = tokenizer.decode_after(row.prompt[-8:], kept) if kept else ""
        replies.append(Reply(row.new, row.sampled, text, answer_text(reply_parts(tokenizer, kept) or text)))
    return [replies[p * group_size : (p + 1) * group_size] for p in range(len(prompts))]


def chat_answers(
    model: GPT, tokenizer: Tokenizer, questions: list[str], max_new_tokens: int, label: str = ""
) -> list[Reply]:
    """Each question's greedy reply of at most max_new_tokens, asked alone in the chat template: what
    ChatSession.reply answers it, decoded together (sample_groups) in passes of REPLY_CACHE_BYTES of keys and
    values, counted at the length the replies need (the cache rounds it up to a power of two, so at most twice
    that)."""
    fmt = chat_format(tokenizer)
    prompts = [fmt.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    cfg, weights = model.config, model.transformer.wte.weight  # the cache takes the embedding's dtype
    length = min(cfg.block_size, max(map(len, prompts)) + max_new_tokens)
    row_bytes = 2 * cfg.n_layer * cfg.kv_heads * length * cfg.head_width * weights.element_size()
    per_pass = max(1, REPLY_CACHE_BYTES // row_bytes)
    replies: list[Reply] = []
    with tqdm(total=len(prompts), desc=label, unit="item", leave=False, disable=None) as bar:
        for first in range(0, len(prompts), per_pass):
            chunk = prompts[first : first + per_pass]
            replies += [
                group[0] for group in sample_groups(model, tokenizer, fmt, chunk, 1, max_new_tokens, 0, None, None)
            ]
            bar.update(len(chunk))
    return replies

"""Many chat replies decoded together, a row each: RL's groups of sampled replies (quillgpt/rl.py) and the greedy
answers of an evaluation's chat tasks (quillgpt/evaluate.py). serve.py's SlotCache holds a row per reply and
GPT.decode_rows takes each row at its own position, so one step decodes every reply still going (a finished one
leaves the batch); calculator calls are answered as in chat.py (quillgpt/tools.py). A greedy reply here is the one
ChatSession.reply gives the same question alone (tests/test_chat.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model import GPT, cache_length, sample_next
from quillgpt.chat_template import ChatFormat
from quillgpt.errors import UserError
from quillgpt.serve.batcher import SlotCache
from quillgpt.tokenizer import Tokenizer
from quillgpt.tools import answer_text, calculator_for, reply_parts


@dataclass
class Reply:
    ids: list[int]  # sampled and inserted ids, the end-of-turn id included where the reply ended with it
    sampled: list[bool]  # per id: the model sampled it (False: a calculator output, inserted)
    text: str = ""  # the reply as ChatSession.reply returns it (the tool's tokens spelled out)
    answer: str = ""  # the text after the calculator's output (tools.answer_text)


PROMPT_LOGITS_BYTES = 64 << 20  # a pass of read_prompts holds at most this much of fp32 logits (one prompt at least)


def read_prompts(model: GPT, prompts: list[list[int]], group_size: int, cache: SlotCache) -> torch.Tensor:
    """Each prompt's keys and values into its group's rows of the cache; each row's next-token logits (rows, V).
    Prompts are read together, right-padded to the longest: causal attention keeps a prompt's positions blind to
    the padding after it (one pass instead of a pass per prompt: a quarter of the time for the RL demo's 18). The
    padding's keys and values are copied with the prompt's, in one copy per layer: a row's positions past its prompt
    are written by its own decoding steps before it attends to them."""
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    per_pass = max(1, PROMPT_LOGITS_BYTES // (4 * width * model.config.vocab_size))
    first = []
    for start in range(0, len(prompts), per_pass):
        chunk = prompts[start : start + per_pass]
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, prompt in enumerate(chunk):
            ids[i, : len(prompt)] = torch.tensor(prompt)
        read = model.new_cache(len(chunk), width)
        logits, _ = model(ids.to(device), cache=read)  # (n, width, V)
        cache.fill(start * group_size, read.k, read.v, each=group_size)
        first += [logits[i, len(prompt) - 1].expand(group_size, -1) for i, prompt in enumerate(chunk)]
    return torch.cat(first)


@torch.no_grad()
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
) -> list[list[Reply]]:
    """group_size replies to each prompt, all decoded together: each prompt is read once (read_prompts) and its keys
    and values copied to its group's rows; then each step samples a token for every row (temperature 0: the most
    likely one) or puts in the next id of a calculator output, until every row has ended or taken max_new_tokens
    (fewer where its prompt leaves less of the context)."""
    block = model.config.block_size
    device = next(model.parameters()).device
    if max(map(len, prompts)) >= block:
        raise UserError(
            f"a prompt of {max(map(len, prompts))} tokens leaves no room for a reply in the context of {block}"
        )
    rows = len(prompts) * group_size
    starts = [len(prompt) for prompt in prompts for _ in range(group_size)]
    budgets = [min(max_new_tokens, block - start) for start in starts]
    # a power of two, as a ChatSession's cache: few distinct sizes for the allocator to reuse, step after step
    cache = SlotCache(model, rows, length=cache_length(max(s + b for s, b in zip(starts, budgets)), block))
    logits = read_prompts(model, prompts, group_size, cache)  # (rows, V)
    new_calculator = calculator_for(tokenizer)
    calculators = [new_calculator() if new_calculator else None for _ in range(rows)]
    inserted: list[list[int]] = [[] for _ in range(rows)]
    replies = [Reply([], []) for _ in range(rows)]
    done = [False] * rows
    decoding = list(range(rows))  # the replies still going: decoding[s] is the one in row s of the cache
    while True:
        # every row is drawn for, the finished ones' stale logits too: a row's draws don't depend on when others end
        picked = sample_next(logits[:, : tokenizer.vocab_size].float(), temperature, top_k, None, generator)
        for i, token in enumerate(picked[:, 0].tolist()):
            if done[i]:
                continue
            forced = bool(inserted[i])
            token = inserted[i].pop(0) if forced else token
            replies[i].ids.append(token)
            replies[i].sampled.append(not forced)
            done[i] = token in fmt.stop_ids or len(replies[i].ids) >= budgets[i]
            if calculators[i] is not None and not done[i]:
                inserted[i] += calculators[i].after(token)
        if all(done):
            break
        # finished replies leave the cache: the last row still going takes each one's place (highest first, so the
        # last row is always one still going), and the step decodes only those
        for row in reversed([row for row, i in enumerate(decoding) if done[i]]):
            if row != len(decoding) - 1:
                cache.relocate_row(len(decoding) - 1, row)
                decoding[row] = decoding[-1]
            decoding.pop()
        tokens = torch.tensor([[replies[i].ids[-1]] for i in decoding], device=device)  # (n, 1)
        at = [starts[i] + len(replies[i].ids) - 1 for i in decoding]
        cache.length = max(at) + 1
        logits[decoding] = model.decode_rows(tokens, torch.tensor(at, device=device), cache).to(logits.dtype)
    for row, reply in enumerate(replies):
        kept = [t for t in reply.ids if t not in fmt.stop_ids]
        reply.text = tokenizer.decode_after(prompts[row // group_size][-8:], kept) if kept else ""
        reply.answer = answer_text(reply_parts(tokenizer, kept) or reply.text)
    return [replies[p * group_size : (p + 1) * group_size] for p in range(len(prompts))]

"""Preference pairs: prepare.py --preference reads records of a prompt, a chosen and a rejected reply, in TRL's forms
(https://huggingface.co/docs/trl/dataset_formats), from .jsonl(.gz/.zst), .parquet, folders of them or a hub
dataset, and renders each side with the tokenizer's chat template:

- conversational, explicit prompt: {"prompt": [messages], "chosen": [messages], "rejected": [messages]}
  ("messages" may stand for "prompt");
- conversational, implicit prompt: {"chosen": [a whole conversation], "rejected": [another]}: the prompt is the
  messages they share from the start, as TRL's extract_prompt finds it (trl-lib/ultrafeedback_binarized's form);
- standard: {"prompt": "text", "chosen": "text", "rejected": "text"}: the prompt is one user message and each reply
  one assistant message (TRL joins standard text without a template; a chat model is asked through its own).

A pair is two conversations of the dataset, one after the other: the prompt with the chosen reply, then the prompt
with the rejected one. Their mask (the tokens the DPO loss counts) is TRL's rule: the tokens of prompt + reply after
those they share with the prompt rendered alone with its generation prompt (the reply, its end-of-turn token and
whatever the template writes after it), the same start for both sides. A message that spells a control token is
encoded as text, as in chat data (chat_template.ChatFormat). Validation takes whole pairs, picked by a hash of the
pair's index (pipeline.write_chunk).

A bad record stops prepare with one line naming its file and record (or is counted and skipped with
--skip-bad-records): not an object, no chosen or rejected, a prompt given as both prompt and messages, text and
conversations mixed, a bad message (chat.check_messages), an implicit prompt in text, or a reply that adds no token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from quillgpt.chat_template import ChatFormat, check_messages, common_prefix, overlapping
from quillgpt.errors import UserError

PAIR_FIELDS = ("prompt", "messages", "chosen", "rejected")


class Pair(NamedTuple):
    """A preference pair as conversations: the prompt (possibly empty) and each reply's messages."""

    prompt: list[dict]
    chosen: list[dict]
    rejected: list[dict]


def pair_of(record: Any, where: str) -> Pair:
    """A record in one of TRL's preference forms as a checked Pair; UserError (one line starting with `where`)."""
    if not isinstance(record, dict):
        raise UserError(f"{where}: the record is a {type(record).__name__}, not an object with chosen and rejected")
    missing = [name for name in ("chosen", "rejected") if record.get(name) is None]
    if missing:
        has = ", ".join(map(repr, list(record)[:8]))
        raise UserError(
            f"{where}: the record has no {missing[0]!r} field (it has {has}); preference records have chosen and "
            "rejected, and a prompt (or messages) unless both replies hold the whole conversation"
        )
    if record.get("prompt") is not None and record.get("messages") is not None:
        raise UserError(f"{where}: the record has both 'prompt' and 'messages': give the prompt once")
    prompt = record.get("prompt", record.get("messages"))
    chosen, rejected = record["chosen"], record["rejected"]
    texts = [isinstance(v, str) for v in (prompt, chosen, rejected) if v is not None]
    if any(texts) and not all(texts):
        raise UserError(f"{where}: prompt, chosen and rejected must all be text or all be lists of messages")
    if all(texts):
        if prompt is None:
            raise UserError(f"{where}: text replies need a 'prompt' (an implicit prompt must be in conversations)")
        prompt, chosen, rejected = (
            [{"role": "user", "content": prompt}],
            [{"role": "assistant", "content": chosen}],
            [{"role": "assistant", "content": rejected}],
        )
    elif prompt is None:
        prompt, chosen, rejected = implicit_prompt(chosen, rejected)
    return Pair(
        check_messages(prompt, f"{where} (prompt)") if prompt else [],
        check_messages(chosen, f"{where} (chosen)"),
        check_messages(rejected, f"{where} (rejected)"),
    )


def implicit_prompt(chosen: Any, rejected: Any) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) from two whole conversations, as TRL's extract_prompt splits them: at the first
    message where they differ (or, when one is a prefix of the other, at the shorter one's last message)."""
    if not isinstance(chosen, list) or not isinstance(rejected, list) or not chosen or not rejected:
        return [], chosen, rejected  # check_messages names the fault
    at = 0
    for at in range(min(len(chosen), len(rejected))):
        if chosen[at] != rejected[at]:
            break
    return chosen[:at], chosen[at:], rejected[at:]


def conversation_ids(fmt: ChatFormat, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """A whole conversation's ids, its content's control-token spellings encoded as text, and per id whether it is
    part of a calculator's output (<|output_start|> through <|output_end|>: the sampler inserts those)."""
    rendered, literals = fmt.literal_content(messages)
    full = fmt.render(rendered)
    ids, starts = fmt.tokenizer.encode_chat(full, literals)
    return ids, overlapping(starts, len(full), fmt.tool_output_spans(full))


def encode_pair(fmt: ChatFormat, pair: Pair) -> tuple[list[int], list[int], list[int], list[int]]:
    """(chosen ids, chosen mask, rejected ids, rejected mask): each side's conversation and 1 on its reply's tokens,
    which start where the prompt rendered with its generation prompt stops agreeing with either side (TRL's
    common_prefix rule), but for a calculator's outputs in a reply: the model never predicts those (as in chat SFT)."""
    prompt = fmt.prompt_ids(pair.prompt)
    chosen, chosen_inserted = conversation_ids(fmt, pair.prompt + pair.chosen)
    rejected, rejected_inserted = conversation_ids(fmt, pair.prompt + pair.rejected)
    start = min(common_prefix(prompt, chosen), common_prefix(prompt, rejected))
    for name, ids in (("chosen", chosen), ("rejected", rejected)):
        if len(ids) <= start:
            raise UserError(f"the {name} reply adds no token to the prompt")

    def mask(inserted: list[bool]) -> list[int]:
        return [int(i >= start and not out) for i, out in enumerate(inserted)]

    return chosen, mask(chosen_inserted), rejected, mask(rejected_inserted)

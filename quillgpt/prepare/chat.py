"""Conversations: prepare.py --chat reads records whose `messages` field (--text-field renames it) is a list of
{"role": "system" | "user" | "assistant", "content": str}, from .jsonl(.gz/.zst), .parquet (a list-of-struct
column), directories of them, or a hub dataset, and renders each with the tokenizer's chat template
(quillgpt/chat_template.py: the model's own, or ChatML with <|im_start|>/<|im_end|> added to our tokenizers).

Every conversation is one document of the docs split: whole conversations go to val by hash (splits.in_validation).
Besides train.bin and val.bin a chat dataset holds, per split, <split>.mask.bin (uint8, one per token: 1 where the
token is the assistant's, its end-of-turn token included, the tokens the loss counts) and <split>.starts.bin (int64,
the offset of each conversation's first token): batches start their rows there (data.py).

A bad record stops prepare with one line naming its file and record (line number of a .jsonl, row of a .parquet,
record number of a hub stream) and removes the partial work: not an object, no messages field, an empty or non-list
messages, a message with a missing or unknown role, non-string content, no assistant message, or a conversation the
template refuses (or, with a checkpoint's char tokenizer, a character it lacks). --skip-bad-records counts and skips
them instead (meta.json's skipped_records, printed). A conversation longer than the model's context is kept whole:
rows cut it at block_size and train.py prints how many are cut.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from quillgpt.chat_template import CHAT_TOKENS, CHATML_TEMPLATE, ChatFormat, check_messages, render
from quillgpt.corpus import Chunk, Documents, JsonLines, ParquetRows, Texts, parquet_file
from quillgpt.errors import UserError
from quillgpt.prepare.preference import PAIR_FIELDS, Pair, encode_pair, pair_of

SKIP_HINT = "; fix it, or pass --skip-bad-records to count and skip such conversations"


@dataclass
class Conversations:
    """A chunk's good conversations in order, each with where it came from (for an error naming the record)."""

    items: list[tuple[str, list[dict] | Pair]] = field(default_factory=list)  # (where, messages or a Pair)
    skipped: int = 0


def record_messages(record: object, name: str, where: str, skip_bad: bool) -> list[dict] | None:
    """The record's checked conversation; None (skip it) or a UserError (one line starting with `where`)."""
    try:
        if not isinstance(record, dict):
            raise UserError(f"{where}: the record is a {type(record).__name__}, not an object with a {name!r} field")
        if name not in record:
            raise UserError(
                f"{where}: the record has no {name!r} field (it has {', '.join(map(repr, list(record)[:8]))}); "
                "name the conversation field with --text-field"
            )
        return check_messages(record[name], where, need_assistant=True)
    except UserError as e:
        if skip_bad:
            return None
        raise UserError(f"{e}{SKIP_HINT}") from None


def record_pair(record: object, name: str, where: str, skip_bad: bool) -> Pair | None:
    """The record's checked preference pair (preference.py); None (skip it) or a UserError, as record_messages."""
    try:
        return pair_of(record, where)
    except UserError as e:
        if skip_bad:
            return None
        raise UserError(f"{e}{SKIP_HINT}") from None


def record_reader(preference: bool) -> Callable:
    """What a record becomes: a preference pair (prepare.py --preference) or a conversation (--chat)."""
    return record_pair if preference else record_messages


def read_conversations(chunk: Chunk, record: Callable = record_messages) -> Conversations:
    """The conversations (or, with record_pair, preference pairs) of a chunk of records (in a worker process)."""
    if isinstance(chunk, JsonLines):
        return json_line_conversations(chunk, record)
    if isinstance(chunk, ParquetRows):
        return parquet_conversations(chunk, record)
    if isinstance(chunk, Texts):  # a hub stream's records, checked as they were read (corpus.hub_chunks)
        return Conversations([(f"record {i}", m) for i, m in enumerate(chunk.texts)], chunk.skipped)
    raise UserError("--chat reads records (.jsonl or .parquet files, or a hub dataset), not text files")


def json_line_conversations(chunk: JsonLines, record: Callable = record_messages) -> Conversations:
    out = Conversations()
    for number, line in enumerate(chunk.data.split(b"\n"), chunk.first_line):
        if not line.strip():
            continue
        where = f"{chunk.path}:{number}"
        try:
            parsed = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            if not chunk.skip_bad:
                raise UserError(f"{where}: not a JSON object ({e}){SKIP_HINT}") from None
            out.skipped += 1
            continue
        messages = record(parsed, chunk.field, where, chunk.skip_bad)
        if messages is None:
            out.skipped += 1
        else:
            out.items.append((where, messages))
    return out


def parquet_conversations(chunk: ParquetRows, record: Callable = record_messages) -> Conversations:
    """A row group's records: its conversation column (preference pairs: the columns of PAIR_FIELDS it has)."""
    pf = parquet_file(chunk.path)
    first_row = sum(pf.metadata.row_group(g).num_rows for g in range(chunk.row_group))
    names = pf.schema_arrow.names
    columns = [c for c in PAIR_FIELDS if c in names] if record is record_pair else [chunk.field]
    rows = pf.read_row_group(chunk.row_group, columns=columns).to_pylist()
    out = Conversations()
    for number, values in enumerate(rows, first_row):
        where = f"{chunk.path} row {number}"
        parsed = {name: value for name, value in values.items() if value is not None}
        messages = record(parsed, chunk.field, where, chunk.skip_bad)
        if messages is None:
            out.skipped += 1
        else:
            out.items.append((where, messages))
    return out


def conversation_text(messages: list[dict]) -> str:
    """A conversation as ChatML without its special tokens: the characters a char vocabulary (or a BPE) built for
    chat data must know."""
    text = render(CHATML_TEMPLATE, messages, False, {})
    for token in CHAT_TOKENS:
        text = text.replace(token, "")
    return text


def conversation_documents(chunk: Chunk, preference: bool = False) -> Documents:
    """A chunk's conversations (a pair: both of its conversations) as texts, for building a char or BPE vocabulary."""
    convs = read_conversations(chunk, record_reader(preference))
    if preference:
        texts = [conversation_text(p.prompt + reply) for _, p in convs.items for reply in (p.chosen, p.rejected)]
        return Documents(texts, convs.skipped)
    return Documents([conversation_text(m) for _, m in convs.items], convs.skipped)


def encode_conversations(fmt: ChatFormat, convs: Conversations, skip_bad: bool) -> tuple[list, list, int]:
    """(ids per conversation, mask per conversation, skipped): a conversation the template or the tokenizer refuses
    is one line naming its record, or skipped with skip_bad."""
    ids, masks, skipped = [], [], convs.skipped
    for where, messages in convs.items:
        try:
            i, m = fmt.encode(messages)
        except UserError as e:
            if skip_bad:
                skipped += 1
                continue
            raise UserError(f"{where}: {e}{SKIP_HINT}") from None
        ids.append(i)
        masks.append(m)
    return ids, masks, skipped


def encode_pairs(fmt: ChatFormat, convs: Conversations, skip_bad: bool) -> tuple[list, list, int]:
    """encode_conversations for preference pairs: two conversations a pair, the chosen then the rejected, each
    masked on its reply (preference.encode_pair)."""
    ids, masks, skipped = [], [], convs.skipped
    for where, pair in convs.items:
        try:
            chosen, chosen_mask, rejected, rejected_mask = encode_pair(fmt, pair)
        except UserError as e:
            if skip_bad:
                skipped += 1
                continue
            raise UserError(f"{where}: {e}{SKIP_HINT}") from None
        ids += [chosen, rejected]
        masks += [chosen_mask, rejected_mask]
    return ids, masks, skipped

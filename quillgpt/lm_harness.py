"""EleutherAI's lm-evaluation-harness on any quillgpt model (`pip install '.[eval]'`).

    python eval.py --ckpt checkpoints/base --tasks hellaswag,arc_easy,lambada_openai
    python eval.py --ckpt X --tasks my_task --task-dir my_tasks/      # tasks of your own, as harness YAML

QuillLM is the harness's model interface over our GPT and tokenizer (char, trained BPE, tiktoken):
- loglikelihood: scoring.continuation_logprobs, the scorer HellaSwag uses here too; an empty context
  is <|endoftext|> (the harness's convention) when the tokenizer has one.
- loglikelihood_rolling: the sum of scoring.score_text's windows over the text.
- generate_until: greedy decoding through the engine (quillgpt/engine.py), cut at the first
  stop string.
Chat mode (eval.py --apply-chat-template, the harness's --apply_chat_template): the harness renders each request
with apply_chat_template below (the tokenizer's own template, quillgpt/chat_template.py) and hands over the text;
its special tokens' text becomes their ids (Tokenizer.encode_chat, as transformers tokenizes a rendered chat, with
no BOS added: a template writes its own), and a generation also ends at the template's end-of-turn token.
The harness fetches its tasks' datasets from the Hugging Face hub: offline, only tasks over local
files run (a YAML task with dataset_path: json and data_files).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import torch
from lm_eval.api.model import LM

from model import GPT
from quillgpt.chat_template import chat_format, check_messages
from quillgpt.engine import Engine, Row, RowText, cache_length
from quillgpt.errors import UserError
from quillgpt.scoring import continuation_logprobs, encode_pair, score_text
from quillgpt.tokenizer import Tokenizer


class QuillLM(LM):
    def __init__(self, model: GPT, tokenizer: Tokenizer, autocast=None, chat: bool = False):
        super().__init__()
        self.model, self.tokenizer, self.autocast = model.eval(), tokenizer, autocast
        self._device = next(model.parameters()).device
        self.token_bytes = tokenizer.token_bytes()
        self.format = chat_format(tokenizer) if chat else None  # a UserError when the tokenizer has no template
        self.stop_ids = self.format.stop_ids if chat else frozenset()

    # ---- the harness's chat mode ----------------------------------------------------------------------

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.format is None:
            raise UserError("--apply-chat-template: the model was not opened in chat mode")
        return self.format.render(check_messages(chat_history, "chat template"), add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        """Fingerprints the harness's request cache: the tokenizer and its template."""
        d = json.dumps(self.tokenizer.to_dict(), sort_keys=True)
        return f"quillgpt-{self.tokenizer.kind}-{hashlib.sha256(d.encode()).hexdigest()[:16]}"

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def encode_context(self, context: str) -> list[int]:
        """A request's context: a rendered chat (special tokens as their ids), or plain text after the BOS."""
        if self.format is not None:
            return self.tokenizer.encode_chat(context)[0]
        return self.tokenizer.prompt_ids(context)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) by scoring.encode_pair's rule; in chat mode over encode_chat."""
        if self.format is None:
            return encode_pair(self.tokenizer, context, continuation)
        spaces = len(context) - len(context.rstrip(" "))
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = self.tokenizer.encode_chat(context)[0]
        whole = self.tokenizer.encode_chat(context + continuation)[0]
        cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else self.tokenizer.encode_chat(continuation)[0]
        return ctx, cont

    # ---- requests -----------------------------------------------------------------------------------

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(ctx, cont) for ctx, cont in (r.args for r in requests)]
        return [(c.logprob, c.greedy) for c in continuation_logprobs(self.model, pairs, self.autocast)]

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for (text,) in (r.args for r in requests):
            start, ids = encode_pair(self.tokenizer, "", text)
            ids = np.array(start + ids, dtype=np.int64)
            every_token = np.ones_like(self.token_bytes)  # nats of every token, special or not
            out.append(
                -score_text(
                    self.model, [ids], every_token, stride=self.model.config.block_size, autocast=self.autocast
                ).nats
                if len(ids) > 1
                else 0.0
            )
        return out

    @torch.inference_mode()
    def generate_until(self, requests) -> list[str]:
        out = []
        ends = frozenset({self.tokenizer.eot_id} if self.tokenizer.eot_id is not None else ()) | set(self.stop_ids)
        for context, kwargs in (r.args for r in requests):
            until = tuple(s for s in kwargs.get("until", []) if s)
            ids = self.encode_context(context) or [self.tokenizer.eot_id or 0]
            row = Row(ids, max_new=int(kwargs.get("max_gen_toks", 256)), stop_ids=ends, stop=until)
            row.text = RowText(self.tokenizer, ids)
            length = cache_length(len(row.prompt) + row.max_new, self.model.config.block_size)
            engine = Engine(self.model, length=length, vocab_size=self.tokenizer.vocab_size)
            engine.add([row])
            while engine.rows:
                engine.step()
            out.append(row.shown)
        return out


def task_manager(tasks: list[str], task_dir: str | None):
    """The harness's index of tasks: --task-dir's alone when every name asked for is a task of its own there (not a
    group, whose members may be the harness's), else --task-dir's and the harness's. Indexing the harness's ~15,000
    task files takes seconds before anything runs."""
    from lm_eval.tasks import TaskManager

    if task_dir is not None:
        local = TaskManager(include_path=task_dir, include_defaults=False)
        if set(tasks) <= set(local.all_subtasks):
            return local
    return TaskManager(include_path=task_dir)


def run_tasks(
    model: GPT,
    tokenizer: Tokenizer,
    tasks: list[str],
    task_dir: str | None,
    limit: int | None,
    num_fewshot: int | None,
    autocast=None,
    apply_chat_template: bool = False,
) -> dict:
    """The harness's results dict for the tasks; an unknown task is a UserError with the harness's own message.
    apply_chat_template: the harness's chat mode, each request in the tokenizer's chat template."""
    from lm_eval import simple_evaluate

    if task_dir is not None and not Path(task_dir).is_dir():
        raise UserError(f"--task-dir {task_dir} is not a directory")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on defaults it assumed are not ours to show
    manager = task_manager(tasks, task_dir)
    try:
        results = simple_evaluate(
            model=QuillLM(model, tokenizer, autocast, chat=apply_chat_template),
            tasks=tasks,
            limit=limit,
            num_fewshot=num_fewshot,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=0,
            verbosity="ERROR",
            apply_chat_template=apply_chat_template,
        )
    except (KeyError, ValueError) as e:  # the harness names an unknown task so
        first = (str(e).strip().strip("'\"").splitlines() or [type(e).__name__])[0]
        raise UserError(f"lm-evaluation-harness: {first}") from None
    except ConnectionError as e:
        raise UserError(
            f"lm-evaluation-harness could not fetch a task's dataset ({str(e).splitlines()[0]}): "
            "offline, only tasks over local files run (--task-dir)"
        ) from None
    return {
        task: {
            k.removesuffix(",none"): v
            for k, v in metrics.items()  # "acc,none": a metric under no filter
            if "," in k and isinstance(v, (int, float)) and not math.isnan(v)
        }
        for task, metrics in results["results"].items()
    }

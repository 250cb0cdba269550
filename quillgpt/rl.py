"""Reinforcement learning with verifiable rewards (GRPO): train.py with rl.enabled.

Each optimizer step (Reinforcement.step, the run's objective: quillgpt/objective.py) takes rl.prompts_per_step questions of rl.tasks (quillgpt/tasks.py: reverse and count on made-up
words, which a chat model has not memorized and no held-out item uses, or the tasks' training split: rl.questions),
samples rl.group_size replies to each with the KV cache (every reply of the step decoded together, one row each;
calculator calls answered as in chat.py: quillgpt/tools.py), scores every reply, and takes one policy-gradient step
over a row per question (its prompt read once, then each reply after it: Rollouts.rows):

    advantage = (reward - mean of its group) / (std of its group)       (rl.scale_advantages; without: not divided)
    loss = - sum over sampled reply tokens of advantage x log p(token) / the number of such tokens
           + rl.kl_coef x the mean over those tokens of KL(policy || reference)     (optional; k3 estimator)

As nanochat's chat_rl: on-policy, one step per batch of samples, so no ratio or clipping (PPO's) is needed; the loss
is a mean over tokens (DAPO's), not over replies. Only the tokens the model sampled count: not the prompt, not the
calculator's outputs (inserted), not padding. A reply's end-of-turn token counts, so stopping at the right place is
learned too. The reference for the KL penalty is run.init_from's model, loaded again (a resumed run has it too).

The reward is the task's grader (exact answer: 1, else 0; tasks.grade), or rl.reward, a function of your own file
('file.py:function' or 'module:function'), called as function(question, reply, answer) -> float where reply is the
text after the calculator's output (tools.answer_text) and answer the item's right answer. It is imported from the
file the config names: nothing in the data names code.

Exact resume: the questions of step k and the generator the replies are sampled with are functions of (run.seed, k)
alone, as the trainer's batches are (data.py): the sampling RNG's state at any step is that seed, so a resumed run
samples exactly the replies the uninterrupted run did (tests/test_rl.py). Checkpoints, logging, evaluation and the
best checkpoint are the trainer's own; evaluations add task_acc, the greedy accuracy on the tasks' validation items,
graded as eval.py --chat-task grades the test items (training.best_metric = "task_acc" keeps the best by it; no test
item is read during training).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn import functional as F

from model import GPT
from quillgpt import tasks
from quillgpt.chat_template import ChatFormat, chat_format
from quillgpt.config import RLConfig
from quillgpt.data import BatchSource, Dataset
from quillgpt.errors import UserError
from quillgpt.evaluate import run_chat_tasks
from quillgpt.moe import RouterTally
from quillgpt.objective import LanguageModeling, Trainer, apply_gradients
from quillgpt.replies import Reply, sample_groups
from quillgpt.tokenizer import Tokenizer

RewardFn = Callable[[str, str, str], float]  # (question, reply, answer) -> reward


# ---- rewards ------------------------------------------------------------------------------------------------


def grader_reward(question: str, reply: str, answer: str) -> float:
    """The synthetic tasks' grader: 1 for the exact answer (tasks.grade's rule), else 0."""
    return float(tasks.grade(tasks.Item("", "", question, answer), reply))


def load_reward(spec: str) -> RewardFn:
    """rl.reward: 'path/to/file.py:function' (imported from that file) or 'module:function' (from the import path)."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UserError(f"rl.reward = {spec!r}: no file {path}")
        module_spec = importlib.util.spec_from_file_location(f"quillgpt_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise UserError(f"rl.reward = {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:
            raise UserError(f"rl.reward = {spec!r}: cannot import {where}: {type(e).__name__}: {e}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"rl.reward = {spec!r}: {where} has no function {name!r}")
    return function


def score(reward: RewardFn, spec: str, item: tasks.Item, reply: str) -> float:
    try:
        value = reward(item.question, reply, item.answer)
    except Exception as e:
        raise UserError(f"rl.reward = {spec!r} failed on {item.question!r}: {type(e).__name__}: {e}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(
            f"rl.reward = {spec!r} returned {value!r} for {item.question!r}: it must return a finite number"
        )
    return float(value)


# ---- the step -----------------------------------------------------------------------------------------------


@dataclass
class Rollouts:
    """A step's questions, their replies and rewards: what the policy-gradient pass reads."""

    prompts: list[list[int]]
    replies: list[list[Reply]]  # per prompt, its group
    rewards: torch.Tensor  # (prompts, group_size)

    def advantages(self, scale: bool) -> torch.Tensor:
        """(prompts, group): each reward against its group's mean (and over its std, scale)."""
        centred = self.rewards - self.rewards.mean(dim=1, keepdim=True)
        return centred / (self.rewards.std(dim=1, unbiased=False, keepdim=True) + 1e-4) if scale else centred

    def lengths(self) -> list[int]:
        """Each question's row in rows(): its prompt but the last token, then each reply's inputs."""
        return [len(prompt) - 1 + sum(len(r.ids) for r in group) for prompt, group in zip(self.prompts, self.replies)]

    def rows(self, device: torch.device, advantages: torch.Tensor) -> QuestionRows:
        """A row per question, padded: its prompt but the last token, read once, then each reply of its group as a
        document that continues the prompt (model.DocumentMask), whose inputs are the prompt's last token and the
        reply's ids but the last, at the positions they have after the prompt. A reply so sees the prompt and
        itself only: its log-probs are those of the row prompt + reply alone, at a fraction of the positions (a
        prompt is most of a reply's row in the chat demo). advantages (prompts, group)."""
        rows = []
        for prompt, group, adv in zip(self.prompts, self.replies, advantages.tolist()):
            n = len(prompt) - 1
            ids, pos, targets, weights = prompt[:-1], list(range(n)), [-1] * n, [0.0] * n
            for reply, a in zip(group, adv):
                ids += prompt[-1:] + reply.ids[:-1]
                pos += range(n, n + len(reply.ids))
                targets += [t if counted else -1 for t, counted in zip(reply.ids, reply.sampled)]
                weights += [a] * len(reply.ids)
            rows.append((ids, pos, targets, weights))
        T = max(len(row[0]) for row in rows)
        x, positions = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
        y, weights = torch.full((len(rows), T), -1, dtype=torch.long), torch.zeros(len(rows), T)
        for i, (ids, pos, targets, w) in enumerate(rows):
            x[i, : len(ids)], positions[i, : len(ids)] = torch.tensor(ids), torch.tensor(pos)
            y[i, : len(ids)], weights[i, : len(ids)] = torch.tensor(targets), torch.tensor(w)
        # padding: position 0 everywhere, so each padded token is a document of its own that nothing attends to
        return QuestionRows(x.to(device), positions.to(device), y.to(device), weights.to(device))


class QuestionRows(NamedTuple):
    """Rollouts.rows: (questions, T) each."""

    x: torch.Tensor  # input ids
    positions: torch.Tensor  # each input's position (model.GPT.forward's positions)
    y: torch.Tensor  # targets: the sampled tokens; -1 where nothing is learned (prompt, calculator output, padding)
    weights: torch.Tensor  # each target's advantage (its reply's), 0 where nothing is learned


def length_parts(lengths: list[int], max_rows: int, waste: float = 0.1, most: int = 8) -> list[list[int]]:
    """The policy-gradient pass's micro-batches: row indices sorted by length, longest first, cut into the fewest
    equal parts (each at most max_rows rows) whose padding, each part to its own longest row, is at most `waste` of
    the real positions; at most `most` parts unless max_rows asks for more (each part is a pass of its own). A step's
    questions differ in length (a reversed word against a calculator call)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n, least = len(order), math.ceil(len(order) / max_rows)
    for k in range(least, max(least, most) + 1):
        parts = [order[i * n // k : (i + 1) * n // k] for i in range(k)]
        if sum(len(part) * lengths[part[0]] for part in parts) <= (1 + waste) * sum(lengths):
            break
    return parts


def token_logprobs(model: GPT, rows: QuestionRows, autocast) -> torch.Tensor:
    """log p(y | x) per position (rows, T) in fp32, 0 where y is -1: the policy-gradient pass's view of the sampled
    tokens, which must be the sampler's own (on-policy; tests/test_rl.py checks that they agree)."""
    with autocast:
        logits, _ = model(rows.x, positions=rows.positions)
    logp = -F.cross_entropy(logits.float().flatten(0, 1), rows.y.flatten(), ignore_index=-1, reduction="none")
    return logp.view_as(rows.y)


class Reinforcement(LanguageModeling):
    """RL's objective: the trainer's fit() steps on it (step: rollouts, rewards, the policy-gradient pass) and its
    evaluation adds the tasks' held-out accuracy (metrics) to the chat data's language-model figures."""

    name, loss_name = "rl", "policy loss"

    def __init__(
        self,
        cfg: RLConfig,
        seed: int,
        tokenizer: Tokenizer,
        fmt: ChatFormat,
        reward: RewardFn,
        reference: GPT | None,
        pools: dict[str, list[tuple]],
        batches: BatchSource,
        routing: RouterTally | None,
    ):
        super().__init__(batches, routing)
        self.cfg, self.seed, self.tokenizer, self.fmt, self.reward = cfg, seed, tokenizer, fmt, reward
        self.reference = reference  # kl_coef > 0: run.init_from's model, frozen
        self.pools = pools  # each task's training items' keys
        self.tokens = 0  # tokens in the last step's policy-gradient pass (prompts and replies)
        self.recent: list[tuple[float, float, float]] = []  # per step since figures(): reward, length, kl

    def tokens_per_step(self, tr: Trainer, it: int | None = None) -> int:
        return self.tokens

    def batch_line(self, tr: Trainer) -> str:
        r = self.cfg
        return (
            f"rl: {r.prompts_per_step} questions ({', '.join(r.tasks)}) x {r.group_size} replies a step, at most "
            f"{r.max_new_tokens} tokens each | reward: {r.reward or 'the task grader'} | kl_coef {r.kl_coef} | "
            f"policy-gradient passes of {tr.cfg.training.batch_size} rows"
        )

    def evaluate(self, tr: Trainer, batches: int) -> dict[str, float]:
        return {**super().evaluate(tr, batches), **self.metrics(tr)}

    def items(self, it: int) -> list[tasks.Item]:
        """Step it's questions: a function of (seed, it), the tasks in turn; on made-up words (rl.questions)."""
        rng = random.Random(f"rl:{self.seed}:{it}")
        names = self.cfg.tasks
        out = []
        for i in range(self.cfg.prompts_per_step):
            task = tasks.TASKS[names[(it * self.cfg.prompts_per_step + i) % len(names)]]
            made_up = self.cfg.questions == "made_up" and task.made_up is not None
            key = task.made_up(rng) if made_up else rng.choice(self.pools[task.name])
            out.append(task.item(key, rng.choice(task.phrasings)))
        return out

    def generator(self, it: int, device: torch.device) -> torch.Generator:
        """Step it's sampling RNG, seeded from (seed, it): what a resumed run needs of the sampler's state."""
        digest = hashlib.sha256(f"rl-sampling:{self.seed}:{it}".encode()).digest()
        return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "big") >> 1)

    def rollouts(self, tr: Trainer, it: int) -> tuple[list[tasks.Item], Rollouts]:
        model, c = tr.raw_model, self.cfg
        model.eval()
        generator = self.generator(it, tr.rt.device)
        items = self.items(it)
        prompts = [self.fmt.prompt_ids([{"role": "user", "content": item.question}]) for item in items]
        with tr.rt.autocast:
            replies = sample_groups(
                model,
                self.tokenizer,
                self.fmt,
                prompts,
                c.group_size,
                c.max_new_tokens,
                c.temperature,
                c.top_k or None,
                generator,
            )
        spec = c.reward or "the task's grader"
        rewards = torch.tensor(
            [[score(self.reward, spec, item, r.answer) for r in group] for item, group in zip(items, replies)]
        )
        return items, Rollouts(prompts, replies, rewards)

    def step(self, tr: Trainer, it: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step: sample, score, and the policy-gradient pass over a row per question (Rollouts.rows),
        in parts of questions of similar length, at most training.batch_size replies each (length_parts). Returns
        (loss, grad norm, skipped) as Objective.step does."""
        _, rollouts = self.rollouts(tr, it)
        device = tr.rt.device
        rows = rollouts.rows(device, rollouts.advantages(self.cfg.scale_advantages))
        counted = (rows.y >= 0).sum().clamp(min=1)
        lengths = rollouts.lengths()
        model = tr.raw_model  # eager: every step's rows have another length
        model.train()
        total, kl_total = torch.zeros((), device=device), torch.zeros((), device=device)
        self.tokens = 0
        most = max(1, tr.cfg.training.batch_size // self.cfg.group_size)  # questions a pass, for batch_size replies
        for part in length_parts(lengths, most):
            T = max(lengths[i] for i in part)
            index = torch.tensor(part, device=device)
            loss, kl = self.loss(model, QuestionRows(*(t[index, :T] for t in rows)), counted, tr.rt.autocast)
            tr.scaler.scale(loss).backward()
            total += loss.detach()
            kl_total += kl
            self.tokens += len(part) * T
        norm, skipped = apply_gradients(tr)
        lengths = [len(r.ids) for group in rollouts.replies for r in group]
        self.recent.append((rollouts.rewards.mean().item(), sum(lengths) / len(lengths), kl_total.item()))
        return total, norm, skipped

    def loss(
        self, model: GPT, rows: QuestionRows, counted: torch.Tensor, autocast
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A part's share of the step's loss, and of the mean KL to the reference (0 without one)."""
        mask = rows.y >= 0
        logp = token_logprobs(model, rows, autocast)  # (rows, T), 0 where nothing is learned
        loss = -(logp * rows.weights).sum() / counted
        kl = torch.zeros((), device=rows.x.device)
        if self.reference is not None and self.cfg.kl_coef > 0:
            with torch.no_grad():
                ref = token_logprobs(self.reference, rows, autocast)
            log_ratio = (ref - logp) * mask
            kl = ((log_ratio.exp() - log_ratio - 1) * mask).sum() / counted  # k3: unbiased, >= 0 per token
            loss = loss + self.cfg.kl_coef * kl
        return loss, kl.detach()

    def figures(self) -> dict[str, float]:
        """The step line's figures, averaged over the steps since the last call: mean reward, reply length, KL."""
        if not self.recent:
            return {}
        n = len(self.recent)
        reward, length, kl = (sum(v[k] for v in self.recent) / n for k in range(3))
        self.recent = []
        out = {"reward": reward, "reply_tokens": length}
        return {**out, "kl": kl} if self.reference is not None else out

    def metrics(self, tr: Trainer) -> dict[str, float]:
        """Accuracy per task on validation items (greedy, graded as eval.py --chat-task grades its test items) and
        their mean, task_acc: the best checkpoint is chosen on items that neither training nor the test split holds."""
        with tr.rt.autocast:
            model, names = tr.raw_model.eval(), list(self.cfg.tasks)
            report = run_chat_tasks(model, self.tokenizer, names, self.cfg.eval_items, split="val")
        accs = {f"{name}_acc": r["acc"] for name, r in report["tasks"].items()}
        return {"task_acc": sum(accs.values()) / len(accs), **accs}


def build_rl(
    cfg: RLConfig, seed: int, dataset: Dataset, reference: GPT | None, batches: BatchSource, routing
) -> Reinforcement:
    """The objective of a run whose config has rl.enabled: its chat format, reward and prompts; reference (kl_coef >
    0): run.init_from's model, frozen here."""
    tokenizer = dataset.tokenizer
    if not tokenizer.chat_template:
        raise UserError("rl.enabled trains a chat model: data.chat = true, with run.init_from's chat tokenizer")
    reward = load_reward(cfg.reward) if cfg.reward else grader_reward
    if reference is not None:
        reference.eval().requires_grad_(False)
    pools = {name: tasks.split_keys(name, "train") for name in cfg.tasks}
    args = (cfg, seed, tokenizer, chat_format(tokenizer), reward, reference, pools, batches, routing)
    return Reinforcement(*args)

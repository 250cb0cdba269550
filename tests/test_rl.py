"""RL with verifiable rewards (quillgpt/rl.py, train.py with rl.enabled): real runs from a tiny chat model. The
policy-gradient step raises the reward it is given; only sampled reply tokens are trained (not the prompt, not the
calculator's outputs); a resumed run continues exactly (its questions and sampling RNG are functions of the step);
the reward comes from the user's own file; the KL penalty is zero at the reference and holds the policy near it;
mistakes are one line."""

import json
import string
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import quillgpt.rl as rl
import quillgpt.tasks as tasks
from model import GPT, GPTConfig
from quillgpt.chat_template import chat_format, with_chat_tokens
from quillgpt.checkpoint import save_checkpoint
from quillgpt.config import ConfigError, RLConfig
from quillgpt.engine import Engine, KVCache
from quillgpt.errors import UserError
from quillgpt.replies import Reply, sample_groups
from quillgpt.rl import Reinforcement, Rollouts, grader_reward, length_parts, load_reward, token_logprobs
from quillgpt.tasks import WORDS, conversations, split_keys, split_of
from quillgpt.tokenizer import CharTokenizer
from train import train

# a reward any model can earn by degrees: the share of 'a' in its reply (the user's own file, as rl.reward names it)
REWARD_SOURCE = """
def reward(question, reply, answer):
    return reply.count("a") / max(len(reply), 1)
"""


def tokenizer():
    return with_chat_tokens(CharTokenizer(sorted(set(string.printable)), eot=True))


@pytest.fixture(scope="module")
def rl_setup(tmp_path_factory) -> dict:
    """A tiny random chat model (the init_from), task conversations for the chat dataset, and a reward file."""
    root = tmp_path_factory.mktemp("rl")
    tok = tokenizer()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=96, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, bias=False))
    save_checkpoint(
        root / "chat.pt",
        {"model": model.state_dict(), "model_args": model.config.to_dict(), "tokenizer": tok.to_dict()},
    )
    with open(root / "tasks.jsonl", "w") as f:
        for messages in conversations(["count", "reverse"], "train", 300, seed=0):
            f.write(json.dumps({"messages": messages}) + "\n")
    (root / "my_reward.py").write_text(REWARD_SOURCE)
    return {"root": root, "ckpt": root / "chat.pt", "input": root / "tasks.jsonl", "reward": root / "my_reward.py"}


def rl_overrides(setup: dict, out: Path, **extra) -> dict:
    o = {
        "run.init_from": str(setup["ckpt"]),
        "run.out_dir": str(out),
        "run.name": "rl",
        "run.device": "cpu",
        "data.dataset": "rl_tasks",
        "data.input": str(setup["input"]),
        "data.data_dir": str(setup["root"] / "data"),
        "data.chat": True,
        "model.block_size": 96,
        "training.precision": "fp32",
        "training.batch_size": 16,
        "training.max_iters": 6,
        "training.eval_interval": 3,
        "training.eval_iters": 2,
        "training.log_interval": 1,
        "training.save_interval": 3,
        "optimizer.learning_rate": 1e-2,
        "optimizer.warmup_iters": 0,
        "optimizer.decay_lr": False,
        "logging.plot": False,
        "rl.enabled": True,
        "rl.prompts_per_step": 2,
        "rl.group_size": 8,
        "rl.max_new_tokens": 8,
        "rl.eval_items": 3,
        "rl.reward": f"{setup['reward']}:reward",
    }
    return {**o, **extra}


def history(run_dir: Path, kind: str = "train") -> list[dict]:
    return [p for p in json.loads((run_dir / "train_log.json").read_text())["history"] if p["kind"] == kind]


def test_rl_raises_the_reward_it_is_given(rl_setup, tmp_path):
    train(None, overrides=rl_overrides(rl_setup, tmp_path, **{"training.max_iters": 30, "training.eval_interval": 0}))
    rewards = [p["reward"] for p in history(tmp_path / "rl")]
    assert len(rewards) == 30
    assert sum(rewards[-5:]) / 5 > 2 * sum(rewards[:5]) / 5 + 0.1  # the share of 'a' grows


def test_a_resumed_rl_run_continues_exactly(rl_setup, tmp_path):
    """6 steps straight == 3, stop, resume to 6 in this process: the same questions, samples, rewards, losses and
    weights (the sampling RNG's state is the step's seed)."""
    train(None, overrides=rl_overrides(rl_setup, tmp_path / "straight"))
    train(None, overrides=rl_overrides(rl_setup, tmp_path / "split", **{"training.max_iters": 3}))
    train(None, overrides={"training.max_iters": 6}, resume=str(tmp_path / "split" / "rl"))
    a, b = history(tmp_path / "straight" / "rl"), history(tmp_path / "split" / "rl")
    pick = ("iter", "loss", "reward", "reply_tokens")
    assert [[p[k] for k in pick] for p in a] == [[p[k] for k in pick] for p in b]
    assert len(a) == 6 and len({p["reward"] for p in a}) > 1
    evals = history(tmp_path / "straight" / "rl", "eval")
    assert {"task_acc", "count_acc", "reverse_acc"} <= set(evals[-1])  # held-out accuracy at each evaluation
    wa = torch.load(tmp_path / "straight" / "rl" / "ckpt_last.pt", weights_only=True)["model"]
    wb = torch.load(tmp_path / "split" / "rl" / "ckpt_last.pt", weights_only=True)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_rl_run_never_reads_a_test_item_and_picks_its_best_checkpoint_on_validation_items(
    rl_setup, tmp_path, monkeypatch
):
    """The evaluations that choose ckpt_best.pt grade val items only, and the steps ask made-up words or the train
    split: no step or evaluation reads a test item, which are eval.py's alone."""
    graded, asked = [], []
    grade, items = tasks.grade, rl.Reinforcement.items
    monkeypatch.setattr(tasks, "grade", lambda item, reply: graded.append(item) or grade(item, reply))
    monkeypatch.setattr(
        rl.Reinforcement, "items", lambda self, step: asked.extend(items(self, step)) or items(self, step)
    )
    overrides = {"training.max_iters": 4, "training.eval_interval": 2, "training.best_metric": "task_acc"}
    train(None, overrides=rl_overrides(rl_setup, tmp_path, **overrides))
    assert len(graded) == 3 * 2 * 3  # 3 evaluations (steps 0, 2, 4) of 3 items of 2 tasks
    assert {split_of(i.task, (i.key,)) for i in graded} == {"val"}
    held_out = {
        (t, ":".join(map(str, k))) for t in ("count", "reverse") for s in ("val", "test") for k in split_keys(t, s)
    }
    assert asked and not any((i.task, i.key) in held_out for i in asked)  # made-up words, or the train split


def test_only_sampled_reply_tokens_are_trained_each_reply_after_its_question_read_once():
    """A question's row holds its prompt once (but the last token), then each reply, whose inputs start from the
    prompt's last token at the positions the reply has after the prompt. The prompt, the calculator's inserted output
    and the padding have target -1; the sampled tokens, the end of turn among them, are the targets, each weighted
    by its reply's advantage."""
    rollouts = Rollouts(
        prompts=[[1, 2, 3], [9, 9]],
        replies=[[Reply([4, 5, 6, 7], [True, False, False, True]), Reply([8], [True])], [Reply([5], [True])] * 2],
        rewards=torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
    )
    assert rollouts.advantages(scale=False).tolist() == [[0.5, -0.5], [0.0, 0.0]]
    assert torch.allclose(rollouts.advantages(scale=True), torch.tensor([[1.0, -1.0], [0.0, 0.0]]), atol=1e-3)
    rows = rollouts.rows(torch.device("cpu"), rollouts.advantages(scale=False))
    assert rows.x.tolist() == [[1, 2, 3, 4, 5, 6, 3], [9, 9, 9, 0, 0, 0, 0]]
    assert rows.positions.tolist() == [[0, 1, 2, 3, 4, 5, 2], [0, 1, 1, 0, 0, 0, 0]]
    assert rows.y.tolist() == [[-1, -1, 4, -1, -1, 7, 8], [-1, 5, 5, -1, -1, -1, -1]]
    assert rows.weights.tolist() == [[0, 0, 0.5, 0.5, 0.5, 0.5, -0.5], [0, 0, 0, 0, 0, 0, 0]]
    assert rollouts.lengths() == [7, 3]


def test_the_pass_over_question_rows_gives_the_loss_and_gradients_of_each_reply_in_a_row_of_its_own(monkeypatch):
    """The policy-gradient pass reads each question once for all its replies (model.DocumentMask), in parts of
    questions of similar length: its loss (advantage-weighted log-probs and the KL penalty) and every gradient equal
    those computed with each reply in a row of its own (prompt + reply, a plain causal forward), in one pass or in
    parts."""
    assert length_parts([5, 9, 5, 9, 5, 9], max_rows=6) == [[1, 3, 5], [0, 2, 4]]
    assert length_parts([7, 7, 7, 7], max_rows=3) == [[0, 1], [2, 3]]  # max_rows first
    assert length_parts([3, 4, 5, 6, 7, 8, 9, 10], max_rows=8, most=2) == [[7, 6, 5, 4], [3, 2, 1, 0]]
    tok = tokenizer()
    torch.manual_seed(0)
    config = GPTConfig(block_size=16, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, bias=False)
    model, reference = GPT(config), GPT(config)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [3, 1]]
    replies = [
        [Reply(list(range(10 + p, 10 + p + n)), [True] * (n - 1) + [p != 1]) for n in (2, 9, 4)] for p in range(3)
    ]
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    rollouts = Rollouts(prompts, replies, rewards)
    assert max(rollouts.lengths()) > config.block_size  # a question's row holds more than a context: positions don't
    pg = Reinforcement(
        RLConfig(kl_coef=0.1, group_size=3), 0, tok, chat_format(tok), grader_reward, reference, {}, None, None
    )

    # each reply alone: its row prompt + reply, the loss written out
    advantages = rollouts.advantages(scale=True)
    nats = kl = counted = 0
    for p, (prompt, group) in enumerate(zip(prompts, replies)):
        for r, reply in enumerate(group):
            ids = torch.tensor([prompt + reply.ids])
            logp = model(ids[:, :-1])[0][0, len(prompt) - 1 :].log_softmax(-1)
            with torch.no_grad():
                ref = reference(ids[:, :-1])[0][0, len(prompt) - 1 :].log_softmax(-1)
            for t, (token, sampled) in enumerate(zip(reply.ids, reply.sampled)):
                if sampled:
                    log_ratio = ref[t, token] - logp[t, token]
                    nats = nats - advantages[p, r] * logp[t, token]
                    kl = kl + log_ratio.exp() - log_ratio - 1
                    counted += 1
    alone = (nats + 0.1 * kl) / counted
    alone.backward()
    expected = [p.grad.clone() for p in model.parameters()]

    monkeypatch.setattr(pg, "rollouts", lambda tr, it: (None, rollouts))
    one_pass = lambda lengths, most: [list(range(len(lengths)))]  # noqa: E731
    for batch_size, split, passes in ((9, length_parts, 2), (3, length_parts, 3), (9, one_pass, 1)):
        trainer = SimpleNamespace(
            raw_model=model,
            model=model,
            optimizers=[],
            scaler=torch.amp.GradScaler(enabled=False),
            rt=SimpleNamespace(device=torch.device("cpu"), autocast=torch.autocast("cpu", enabled=False)),
            cfg=SimpleNamespace(
                training=SimpleNamespace(batch_size=batch_size), optimizer=SimpleNamespace(grad_clip=0.0)
            ),
        )
        monkeypatch.setattr("quillgpt.rl.length_parts", split)
        model.zero_grad(set_to_none=True)
        loss, _, _ = pg.step(trainer, 0)
        torch.testing.assert_close(loss, alone.detach(), rtol=1e-5, atol=1e-6)
        for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        assert len(split(rollouts.lengths(), batch_size // 3)) == passes
    assert pg.tokens < sum(len(p) + len(r.ids) - 1 for p, g in zip(prompts, replies) for r in g)


def rows_that_end_apart():
    """(tokenizer, chat format, a tiny policy, 3 prompts of different lengths): the policy ends its turn now and
    then, so a group's rows finish at different steps."""
    tok = tokenizer()
    fmt = chat_format(tok)
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_embd=32, bias=False))
    end = tok.special_tokens["<|im_end|>"]
    with torch.no_grad():
        model.lm_head.weight[end] *= 6 / model.lm_head.weight[end].norm()
    prompts = [fmt.prompt_ids([{"role": "user", "content": q}]) for q in ("Hi", "Reverse the word card.", "Why?")]
    return tok, fmt, model.eval(), prompts


def test_the_sampler_samples_from_the_policy_the_step_trains(monkeypatch):
    """On-policy: the log-prob the sampler drew each reply token with (rows at their own positions in the slot cache,
    prompts of different lengths, rows that ended early) is the training forward's log-prob of that token as
    Rollouts.rows lays it out (each question read once, its replies after it), for every sampled token of every row."""
    tok, fmt, model, prompts = rows_that_end_apart()
    end = tok.special_tokens["<|im_end|>"]
    added, seen = [], {}  # the engine's rows, in the replies' order; per row, what each of its tokens was drawn from
    add, pick = Engine.add, Engine.pick

    def recording(self, rows):
        logp = self.logits[:, : self.vocab].float().log_softmax(-1)  # (rows in use, V), in the cache's row order
        for i, row in enumerate(rows):
            seen.setdefault(id(row), []).append(logp[i])
        return pick(self, rows)

    monkeypatch.setattr(Engine, "add", lambda self, rows: added.extend(rows) or add(self, rows))
    monkeypatch.setattr(Engine, "pick", recording)
    groups = sample_groups(model, tok, fmt, prompts, 4, 12, 1.0, None, torch.Generator().manual_seed(1))
    replies = [r for g in groups for r in g]
    assert len({len(r.ids) for r in replies}) > 2 and any(r.ids[-1] == end for r in replies)
    sampler = [
        [seen[id(row)][k][t].item() for k, t in enumerate(r.ids) if r.sampled[k]] for row, r in zip(added, replies)
    ]
    rollouts = Rollouts(prompts, groups, torch.zeros(3, 4))
    rows = rollouts.rows(torch.device("cpu"), rollouts.advantages(scale=False))
    with torch.no_grad():
        logp = token_logprobs(model, rows, torch.autocast("cpu", enabled=False))
    trained = [logp[q][rows.y[q] >= 0].tolist() for q in range(len(prompts))]  # a question's replies in turn
    assert [len(t) for t in trained] == [sum(map(len, sampler[4 * q : 4 * q + 4])) for q in range(len(prompts))]
    assert torch.allclose(torch.tensor(sum(trained, [])), torch.tensor(sum(sampler, [])), atol=1e-4)


def test_under_autocast_the_sampler_keeps_keys_and_values_in_its_dtype_and_samples_the_same_replies(monkeypatch):
    """A cache built under autocast (RL's sampler, a bf16 run) is in autocast's dtype: keys and values come in it, so
    it holds them exactly and attention reads it without a conversion every step. Every reply, token for token, is
    the one the cache in the weights' dtype (fp32) gives."""
    tok, fmt, model, prompts = rows_that_end_apart()
    cfg = model.config

    def fp32_cache(model, rows, length):
        length = min(length, cfg.block_size)
        return KVCache(cfg.n_layer, rows, cfg.kv_heads, length, cfg.head_width, torch.device("cpu"), torch.float32)

    assert KVCache.for_model(model, 2, 16).k[0].dtype == torch.float32  # outside autocast: the weights'
    with torch.autocast("cpu", torch.bfloat16):
        assert KVCache.for_model(model, 2, 16).k[0].dtype == torch.bfloat16
        ours = sample_groups(model, tok, fmt, prompts, 4, 12, 1.0, None, torch.Generator().manual_seed(1))
        monkeypatch.setattr(KVCache, "for_model", staticmethod(fp32_cache))
        fp32 = sample_groups(model, tok, fmt, prompts, 4, 12, 1.0, None, torch.Generator().manual_seed(1))
    assert len({len(r.ids) for g in ours for r in g}) > 2  # rows ended apart: relocated rows, shrinking steps
    assert [[r.ids for r in g] for g in ours] == [[r.ids for r in g] for g in fp32]


def test_the_sampler_answers_calculator_calls_and_marks_their_output_inserted():
    from test_tools import call_ids, script_after, scripted_model

    tok = with_chat_tokens(CharTokenizer(sorted(set(string.printable)), eot=True))
    fmt = chat_format(tok)
    prompt = fmt.prompt_ids([{"role": "user", "content": "What is 17 + 25?"}])
    written, output = call_ids(tok, "17+25", "42")
    model = scripted_model(tok, script_after(prompt, written))
    other = fmt.prompt_ids([{"role": "user", "content": "Hi"}])  # shorter: its rows decode at other positions
    groups = sample_groups(model, tok, fmt, [prompt, other], 3, 30, 1.0, 1, torch.Generator().manual_seed(0))
    assert [len(g) for g in groups] == [3, 3]
    for reply in groups[0]:  # top_k 1: greedy, every row the same
        assert reply.answer == "42" and reply.ids[-1] in fmt.stop_ids
        start = reply.ids.index(output[0])
        assert reply.ids[start : start + len(output)] == output
        assert not any(reply.sampled[start : start + len(output)]) and all(reply.sampled[:start])
    end = tok.special_tokens["<|im_end|>"]
    assert [r.ids for r in groups[1]] == [[end]] * 3  # unscripted positions: the model ends its turn at once
    with torch.autocast("cpu", torch.bfloat16):  # as a bf16 run samples: an fp32 cache takes bf16 keys and values
        again = sample_groups(model, tok, fmt, [prompt, other], 3, 30, 1.0, 1, torch.Generator().manual_seed(0))
    assert [[r.ids for r in g] for g in again] == [[r.ids for r in g] for g in groups]


def test_the_kl_penalty_is_zero_at_the_reference_and_holds_the_policy_near_it(rl_setup, tmp_path):
    """The same run with a negligible and with a strong penalty (both measure the KL to run.init_from's model on their
    own samples): zero at the first step, where the policy is the reference; lower with the penalty afterwards."""
    steps = {"training.max_iters": 8, "training.eval_interval": 0}
    train(None, overrides=rl_overrides(rl_setup, tmp_path / "free", **steps, **{"rl.kl_coef": 1e-9}))
    train(None, overrides=rl_overrides(rl_setup, tmp_path / "kl", **steps, **{"rl.kl_coef": 5.0}))
    free, held = ([p["kl"] for p in history(tmp_path / run / "rl")] for run in ("free", "kl"))
    assert free[0] == held[0] == pytest.approx(0.0, abs=1e-6)
    assert sum(held[-4:]) < 0.5 * sum(free[-4:])


def test_rl_mistakes_are_one_line(rl_setup, tmp_path):
    with pytest.raises(ConfigError, match="run.init_from"):
        train(None, overrides={**rl_overrides(rl_setup, tmp_path), "run.init_from": "scratch"})
    with pytest.raises(ConfigError, match="rl.tasks"):
        train(None, overrides=rl_overrides(rl_setup, tmp_path, **{"rl.tasks": ["sudoku"]}))
    with pytest.raises(ConfigError, match="task_acc"):
        train(
            None,
            overrides={**rl_overrides(rl_setup, tmp_path), "rl.enabled": False, "training.best_metric": "task_acc"},
        )
    with pytest.raises(UserError, match="has no function 'nope'"):
        load_reward(f"{rl_setup['reward']}:nope")
    with pytest.raises(UserError, match="no file"):
        load_reward(f"{tmp_path / 'missing.py'}:reward")
    bad = tmp_path / "bad.py"
    bad.write_text("def reward(q, r, a):\n    return 'yes'\n")
    with pytest.raises(UserError, match="must return a finite number"):
        train(None, overrides=rl_overrides(rl_setup, tmp_path / "bad", **{"rl.reward": f"{bad}:reward"}))


def test_questions_are_made_up_words_or_the_training_split_and_a_step_repeats_its_own():
    """rl.questions = "made_up": reverse and count on words no task holds (so never a held-out one), arithmetic from
    its training split; "train": every question from the training split. Step k's questions are a function of
    (seed, k)."""
    tok = tokenizer()
    names = ["reverse", "count", "arithmetic"]
    pools = {name: split_keys(name, "train") for name in names}
    trained = {name: {":".join(map(str, k)) for k in pools[name]} for name in names}

    def questions(kind: str, step: int) -> list:
        cfg = RLConfig(enabled=True, tasks=names, prompts_per_step=60, questions=kind)
        return rl.Reinforcement(cfg, 0, tok, chat_format(tok), rl.grader_reward, None, pools, None, None).items(step)

    made_up = questions("made_up", 0)
    assert [i.task for i in made_up[:3]] == names and made_up == questions("made_up", 0) != questions("made_up", 1)
    for item in made_up:
        word = item.key.split(":")[0]
        assert (item.key in trained[item.task]) == (item.task == "arithmetic")
        assert item.task == "arithmetic" or word not in WORDS
    assert all(item.key in trained[item.task] for item in questions("train", 0))

"""Packed rows that keep their documents apart (data.chat_rows = "packed", data.document_mask): each conversation or
document of a row attends only within itself, at the positions it would have alone, so its logits are the ones it has
alone; the loss counts every conversation's assistant tokens; training, evaluation, resume and DDP pass the positions
with the tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT, resume_in_subprocess, tiny_overrides, train_until_sigterm
from test_chat_data import chat_data, chat_overrides  # noqa: F401 (chat_data: the fixture)

from model import GPT, DocumentMask, GPTConfig, summed_nats
from quillgpt import trainer
from quillgpt.config import ConfigError, build_config
from quillgpt.data import BatchSource, find_dataset, load_dataset, positions_from_starts
from quillgpt.distributed import DistInfo
from quillgpt.errors import UserError
from quillgpt.prepare import prepare_dataset
from train import train

MODELS = {
    "learned": dict(pos_emb="learned"),  # GPT-2's: learned positions, LayerNorm, GELU
    "rope": dict(pos_emb="rope", norm="rmsnorm", qk_norm=True, n_kv_head=1, mlp="relu2", tie_embeddings=False),
}


def tiny_model(kind: str, block_size: int = 48, vocab_size: int = 40, **extra) -> GPT:
    torch.manual_seed(0)
    kw = dict(block_size=block_size, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, dropout=0.0)
    return GPT(GPTConfig(**{**kw, **MODELS[kind], **extra}))


def row_of_documents(lengths: list[list[int]], vocab_size: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids (B, T) of rows made of documents of these lengths, and their positions (B, T)."""
    T = sum(lengths[0])
    first = np.zeros((len(lengths), T), dtype=bool)
    for row, sizes in enumerate(lengths):
        first[row, np.cumsum([0, *sizes[:-1]])] = True
    return torch.randint(0, vocab_size, first.shape), torch.from_numpy(positions_from_starts(first))


def documents_of(positions: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each document of a row, from its positions (T,)."""
    starts = (positions == 0).nonzero().flatten().tolist()
    return list(zip(starts, [*starts[1:], positions.numel()]))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_each_document_of_a_packed_row_has_the_logits_and_gradients_it_has_alone(kind, compiled):
    """Rows of several documents, with their positions: each document's logits are those of the document run alone
    (learned and rotary positions restart, attention stays inside it), and the loss over the row and its gradients
    are those of the documents' summed losses over their counted targets, on the training path (autograd on)."""
    model = tiny_model(kind)
    x, positions = row_of_documents([[7, 12, 13, 16], [48], [1, 30, 17]])
    y = torch.randint(0, 40, x.shape)
    y[0, 3:9] = -1  # targets that do not count, across a document's end
    run = torch.compile(model) if compiled else model
    logits, loss = run(x, y, positions=positions)
    loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    nats, counted = 0, 0
    for row in range(x.size(0)):
        for start, end in documents_of(positions[row]):
            alone, _ = model(x[row : row + 1, start:end])
            torch.testing.assert_close(logits[row, start:end], alone[0], rtol=1e-5, atol=1e-5)
            nats = nats + summed_nats(alone[0], y[row, start:end])
            counted += int((y[row, start:end] >= 0).sum())
    by_documents = nats / counted
    by_documents.backward()
    torch.testing.assert_close(loss, by_documents, rtol=1e-5, atol=1e-6)
    for packed, alone in zip(packed_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-6)
    unmasked, _ = model(x)  # the same row without positions: one sequence, the later documents see the earlier ones
    assert not torch.allclose(unmasked[0, 7:], logits[0, 7:], atol=1e-3)


@pytest.mark.parametrize("window", [0, 3], ids=["full", "sliding"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_a_document_starting_past_position_0_continues_its_rows_first_document(kind, window):
    """Positions that restart at p > 0 (RL's question rows: a prompt read once, then each reply): that document sees
    the row's first document's first p tokens and itself, so its logits are those of the first p tokens and itself
    alone; a row may so hold more tokens than block_size. The FlexAttention block mask sees as the SDPA mask does."""
    model = tiny_model(kind, block_size=12, sliding_window=window).eval()
    prompt, continuations = [5, 6, 7, 8, 9], [[1, 2, 3, 4, 11, 12, 13], [21, 22], [31, 32, 33, 34, 35, 36, 37]]
    shared = [4, 2, 5]  # how many of the prompt's tokens each continuation follows
    x = torch.tensor([prompt + sum(continuations, [])])
    positions = torch.tensor(
        [list(range(5)) + sum((list(range(p, p + len(c))) for p, c in zip(shared, continuations)), [])]
    )
    assert x.size(1) > model.config.block_size
    with torch.no_grad():
        logits, _ = model(x, positions=positions)
        at = 5
        for p, c in zip(shared, continuations):
            alone, _ = model(torch.tensor([prompt[:p] + c]))
            torch.testing.assert_close(logits[0, at : at + len(c)], alone[0, p:], rtol=1e-5, atol=1e-5)
            at += len(c)
        q, k, v = (torch.randn(1, 2, x.size(1), 16) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager FlexAttention on the CPU warns that it is unfused
            flex = DocumentMask(positions, flex=True, window=window).attend(q, k, v, 0.0)
        sdpa = DocumentMask(positions, flex=False, window=window).attend(q, k, v, 0.0)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-6)


def test_flexattention_block_mask_attends_as_the_sdpa_mask():
    """The FlexAttention path (CUDA under torch.compile) builds its block mask from the same positions as the SDPA
    mask: on the CPU (forward only: torch has no FlexAttention backward there) both give the same attention."""
    _, positions = row_of_documents([[5, 40, 19], [64], [1, 1, 62]])
    q, k, v = (torch.randn(3, 2, 64, 16) for _ in range(3))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention on the CPU warns that it is unfused
        flex = DocumentMask(positions, flex=True).attend(q, k, v, 0.0)
        sdpa = DocumentMask(positions, flex=False).attend(q, k, v, 0.0)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-6)


def test_a_packed_chat_batch_restarts_positions_at_each_conversation_and_counts_every_assistant_token(chat_data):  # noqa: F811
    data_dir, _ = chat_data
    dataset = load_dataset(data_dir / "sums")
    packed = BatchSource(dataset, 200, 4, 1337, torch.device("cpu"), chat_rows="packed")
    padded = BatchSource(dataset, 200, 4, 1337, torch.device("cpu"), chat_rows="padded")
    x, y, positions = packed.get("train", 3)
    assert padded.get("train", 3).positions is None  # padded rows count one conversation: no mask needed
    starts, mask = dataset.starts["train"], np.fromfile(dataset.mask_path("train"), dtype=np.uint8)
    for row, start in enumerate(packed.starts("train", 3)):
        offsets = start + np.arange(200)
        first = np.isin(offsets, starts)
        assert (positions[row].numpy() == 0).tolist() == first.tolist() and first.sum() >= 2
        assert ((y[row] >= 0).numpy() == (mask[offsets + 1] == 1)).all()  # every conversation's assistant tokens
    model = tiny_model("learned", block_size=200, vocab_size=dataset.vocab_size)
    _, loss = model(x, y, positions=positions)
    nats, counted = 0, 0
    for row in range(x.size(0)):
        for a, b in documents_of(positions[row]):
            alone, _ = model(x[row : row + 1, a:b])
            nats, counted = nats + summed_nats(alone[0], y[row, a:b]), counted + int((y[row, a:b] >= 0).sum())
    torch.testing.assert_close(loss, nats / counted, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Path:
    """A text dataset `docs` of 300 short documents (jsonl records), each ending with <|endoftext|>."""
    root = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    words = "the king queen lord of and to my thou art not what say speak come go love death night".split()
    records = [{"text": " ".join(rng.choice(words, size=rng.integers(2, 12)))} for _ in range(300)]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_dataset("docs", input_path=str(root / "docs.jsonl"), data_dir=root / "data", verbose=False)
    return root / "data"


def test_document_mask_starts_a_document_after_each_endoftext(documents):
    """A text row's documents are as prepare.py wrote them, [BOS] tokens <|endoftext|>: position 0 at the row's
    first token and after each <|endoftext|>; without data.document_mask, no positions."""
    dataset = load_dataset(documents / "docs")
    eot = dataset.meta["eot_id"]
    x, _, positions = BatchSource(dataset, 64, 4, 1, torch.device("cpu"), document_mask=True).get("train", 0)
    after_eot = torch.cat([torch.ones(4, 1, dtype=torch.bool), x[:, :-1] == eot], dim=1)
    assert torch.equal(positions == 0, after_eot) and (x == eot).sum() > 4
    assert torch.equal(positions[:, 1:][~after_eot[:, 1:]], positions[:, :-1][~after_eot[:, 1:]] + 1)
    assert BatchSource(dataset, 64, 4, 1, torch.device("cpu")).get("train", 0).positions is None


def test_train_step_and_evaluation_run_the_model_on_the_batches_positions(documents, tmp_path):
    """The trainer passes each batch's positions to the model, in the training step and in evaluation: its losses
    are those of model(x, y, positions) and differ from the same rows as single sequences."""
    overrides = tiny_overrides(
        documents, tmp_path, **{"data.dataset": "docs", "data.document_mask": True, "model.dropout": 0.0}
    )
    cfg = build_config(None, overrides)
    tr = trainer.build_trainer(cfg, trainer.setup(cfg, DistInfo()), find_dataset(cfg, DistInfo()))
    expected = {}
    with torch.no_grad():
        for split in ("train", "val"):
            x, y, positions = tr.batches.get(split, 0)
            expected[split] = tr.model(x, y, positions=positions)[1].item()
            assert abs(tr.model(x, y)[1].item() - expected[split]) > 1e-4
    metrics = trainer.eval_metrics(tr, batches=1)
    assert metrics["train_loss"] == pytest.approx(expected["train"], rel=1e-5)
    assert metrics["val_loss"] == pytest.approx(expected["val"], rel=1e-5)
    loss, _, _ = trainer.train_step(tr, 0)
    assert loss.item() == pytest.approx(expected["train"], rel=1e-5)


@pytest.mark.slow
def test_packed_chat_training_resumes_exactly(chat_data, tmp_path, capsys):  # noqa: F811
    data_dir, _ = chat_data
    common = {
        "data.chat_rows": "packed",
        "training.max_iters": 12,
        "training.save_interval": 4,
        "optimizer.lr_decay_iters": 12,
    }
    train(None, overrides=chat_overrides(data_dir, tmp_path / "straight", **common))
    assert "rows packed, each from a conversation start, each conversation attending only within itself" in (
        capsys.readouterr().out
    )
    train_until_sigterm(chat_overrides(data_dir, tmp_path / "split", **common), iter_lines=5)
    resume_in_subprocess(tmp_path / "split" / "t", 12)

    def losses(run: Path) -> dict:
        history = json.loads((run / "train_log.json").read_text())["history"]
        return {(p["kind"], p["iter"]): p.get("loss", p.get("val_loss")) for p in history}

    assert losses(tmp_path / "straight" / "t") == losses(tmp_path / "split" / "t")


def test_document_mask_without_documents_is_one_line(chat_data, tiny_data, tmp_path):  # noqa: F811
    """On chat data (whose packed rows are kept apart already) and on a lone text file (no <|endoftext|>):
    one line, exit 2."""
    with pytest.raises(ConfigError, match="data.document_mask is for text datasets"):
        build_config(None, {"data.chat": True, "data.document_mask": True})
    with pytest.raises(UserError, match="data.document_mask is for text datasets"):
        train(None, overrides=chat_overrides(chat_data[0], tmp_path, **{"data.document_mask": True}))
    proc = subprocess.run(
        [sys.executable, "train.py"]
        + [f"--{k}={v}" for k, v in tiny_overrides(tiny_data, tmp_path, **{"data.document_mask": True}).items()],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is one text, not documents ending with <|endoftext|>" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_packed_rows_on_cuda_train_through_flexattention():
    """On CUDA under torch.compile, packed rows attend through FlexAttention's block mask: each document's logits are
    its logits alone, and a backward pass runs."""
    model = tiny_model("rope", block_size=256).cuda()
    x, positions = row_of_documents([[100, 56, 100], [256]])
    x, positions = x.cuda(), positions.cuda()
    compiled = torch.compile(model)
    logits, loss = compiled(x, x, positions=positions)
    loss.backward()
    for row in range(x.size(0)):
        for start, end in documents_of(positions[row]):
            alone, _ = model(x[row : row + 1, start:end])
            torch.testing.assert_close(logits[row, start:end], alone[0], rtol=1e-4, atol=1e-4)

"""One place decides the model a run trains (quillgpt/run_model.py): train.py --validate sizes the model that
training then builds, whether it is new, resumed, or read from a checkpoint or a Hugging Face directory by
run.init_from (context cropped, vocabulary grown for chat tokens)."""

import json

import pytest
from conftest import save_hf_family, save_hf_tokenizer, tiny_corpus, tiny_overrides

from model import GPT, GPTConfig
from quillgpt.checkpoint import load_checkpoint
from quillgpt.tasks import conversations
from train import train


def validated_then_trained(overrides: dict, resume: str | bool = False) -> tuple[dict, dict]:
    """What train.py --validate checked, and the model_args of the checkpoint the same run then wrote."""
    checked = train(None, overrides=overrides, resume=resume, validate_only=True)
    result = train(None, overrides=overrides, resume=resume)
    return checked, load_checkpoint(result.checkpoint_path)["model_args"]


def assert_same_model(checked: dict, built_args: dict) -> None:
    assert checked["model_args"] == built_args
    assert checked["parameters"] == GPT(GPTConfig.from_dict(built_args)).num_params()


def test_validate_sizes_the_new_model_train_builds(tiny_data, tmp_path):
    checked, built = validated_then_trained(tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 2}))
    assert_same_model(checked, built)
    assert built["n_embd"] == 32 and built["vocab_size"] == checked["model_args"]["vocab_size"]


def test_validate_sizes_the_resumed_model_train_builds(tiny_data, tmp_path):
    overrides = tiny_overrides(tiny_data, tmp_path, **{"training.max_iters": 2})
    train(None, overrides=overrides)
    checked, built = validated_then_trained({"training.max_iters": 4}, resume=str(tmp_path / "t"))
    assert_same_model(checked, built)


def test_validate_sizes_the_init_from_checkpoint_model_with_its_context_cropped(tiny_data, tmp_path):
    train(None, overrides=tiny_overrides(tiny_data, tmp_path / "base", **{"training.max_iters": 2}))
    overrides = tiny_overrides(
        tiny_data,
        tmp_path / "ft",
        **{"run.init_from": str(tmp_path / "base" / "t"), "model.block_size": 16, "training.max_iters": 2},
    )
    del overrides["model.n_layer"], overrides["model.n_embd"]  # the checkpoint's, whatever the config says
    checked, built = validated_then_trained(overrides)
    assert_same_model(checked, built)
    assert (built["block_size"], built["n_layer"], built["n_embd"]) == (16, 2, 32)


def test_validate_sizes_the_init_from_hf_model_with_the_chat_tokens_grown(tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = tmp_path / "llama"
    save_hf_family(transformers, "llama", llama)
    save_hf_tokenizer(transformers, llama, tiny_corpus())  # all 300 ids: the chat tokens need new rows
    chats = tmp_path / "chats.jsonl"
    rows = conversations(["arithmetic", "reverse"], "train", 120, seed=0, turns=1)
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    overrides = {
        "run.init_from": str(llama),
        "run.out_dir": str(tmp_path / "runs"),
        "run.name": "sft",
        "run.device": "cpu",
        "data.dataset": "chats",
        "data.input": str(chats),
        "data.chat": True,
        "data.data_dir": str(tmp_path / "data"),
        "model.block_size": 64,
        "training.precision": "fp32",
        "training.batch_size": 2,
        "training.max_iters": 2,
        "training.eval_interval": 2,
        "training.eval_iters": 1,
        "logging.plot": False,
    }
    checked, built = validated_then_trained(overrides)
    assert_same_model(checked, built)
    assert built["vocab_size"] > 300 and built["block_size"] == 64  # grown for the chat tokens, cropped from 128

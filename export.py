"""Models out: Hugging Face directories and plain safetensors files (quillgpt/loading.py brings models in).

    python export.py --ckpt checkpoints/base --hf exports/base-hf                  # a run dir: its ckpt_best.pt
    python export.py --ckpt checkpoints/base/ckpt_last.pt --safetensors exports/base.safetensors

The Hugging Face directory loads with transformers.AutoModelForCausalLM.from_pretrained and gives
the same logits. Its architecture follows the model's switches (hf.py): GPT-2 for learned positions,
LayerNorm and GELU; Llama for rope + RMSNorm + SwiGLU (any n_kv_head, tied or not); Qwen2 with
qkv_bias; Qwen3 with qk_norm. A switch no architecture expresses (relu2, a logit soft-cap, ...) is
refused with the nearest setting that exports. The tokenizer goes with it as tokenizer.json, which
transformers.AutoTokenizer loads and which encodes and decodes as ours does (char, bpe, tiktoken
and Hugging Face tokenizers alike). The safetensors file takes any model: the weights, plus the
model arguments and the tokenizer as JSON in its metadata (sample.py --ckpt reads it).

From Python:

    from export import export_safetensors
    from quillgpt.hf import export_hf
    from quillgpt.loading import load_model
    loaded = load_model("checkpoints/base")
    export_safetensors(loaded.model, loaded.tokenizer, "exports/base.safetensors")
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import save

from model import GPT
from quillgpt import hf
from quillgpt.errors import run_main
from quillgpt.files import atomic_write
from quillgpt.loading import load_model

# ---- export: safetensors ----------------------------------------------------------------------------


def export_safetensors(model: GPT, tokenizer: dict | None, path: str | Path) -> None:
    """The weights plus model arguments and tokenizer (JSON strings in the metadata); a tied head is stored once."""
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        del state["transformer.wte.weight"]  # the same tensor as lm_head.weight; safetensors refuses shared tensors
    metadata = {"format": "pt", "model_args": json.dumps(model.config.to_dict())}
    if tokenizer is not None:
        metadata["tokenizer"] = json.dumps(tokenizer)
    with atomic_write(path) as f:
        f.write(save(state, metadata=metadata))


# ---- command line -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt", required=True, help="checkpoint file, run directory (its ckpt_best.pt) or .safetensors file"
    )
    p.add_argument("--hf", metavar="OUT_DIR", help="write a Hugging Face directory (GPT-2, Llama, Qwen2 or Qwen3)")
    p.add_argument(
        "--safetensors", metavar="OUT", help="write one .safetensors file with the model arguments in its metadata"
    )
    args = p.parse_args(argv)
    if not args.hf and not args.safetensors:
        p.error("give --hf OUT_DIR and/or --safetensors OUT.safetensors")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loaded = load_model(args.ckpt)
    model, tokenizer, source = loaded.model, loaded.tokenizer, loaded.source
    if args.hf:  # refuse before writing anything
        hf.export_family(model.config, str(source), tokenizer)
    if args.safetensors:
        export_safetensors(model, tokenizer, args.safetensors)
        print(f"wrote {args.safetensors}")
    if args.hf:
        for note in hf.export_hf(model, tokenizer, args.hf, str(source)):
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {args.hf} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


if __name__ == "__main__":
    run_main(main)

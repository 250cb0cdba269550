"""Models out: Hugging Face directories, plain safetensors files and GGUF files for llama.cpp and Ollama
(quillgpt/loading.py brings models in).

    python export.py --ckpt checkpoints/base --hf exports/base-hf                  # a run dir: its ckpt_best.pt
    python export.py --ckpt checkpoints/base/ckpt_last.pt --safetensors exports/base.safetensors
    python export.py --ckpt checkpoints/base --gguf exports/base.gguf --outtype q8_0   # and exports/base.Modelfile
    python export.py --ckpt checkpoints/smollm2-135m-lora --peft exports/lora-adapter    # a LoRA run's adapters (PEFT)
    python export.py --ckpt checkpoints/smollm2-135m-lora --merge --gguf exports/smollm2-lora.gguf   # folded in

The Hugging Face directory loads with transformers.AutoModelForCausalLM.from_pretrained and gives
the same logits. Its architecture follows the model's switches (hf.py): GPT-2 for learned positions,
LayerNorm and GELU; Llama for rope + RMSNorm + SwiGLU (any n_kv_head, tied or not); Qwen2 with
qkv_bias; Qwen3 with qk_norm. A switch no architecture expresses (relu2, a logit soft-cap, ...) is
refused with the nearest setting that exports. The tokenizer goes with it as tokenizer.json, which
transformers.AutoTokenizer loads and which encodes and decodes as ours does (char, bpe, tiktoken
and Hugging Face tokenizers alike). The safetensors file takes any model: the weights, plus the
model arguments and the tokenizer as JSON in its metadata (sample.py --ckpt reads it). The GGUF file
(quillgpt/gguf_export.py) takes the Hugging Face architecture and the tokenizer as llama.cpp's byte-level BPE,
f32, f16 (the default), bf16, q8_0 or q4_0, with its own Ollama Modelfile beside it (base.gguf: base.Modelfile, for
ollama create NAME -f base.Modelfile); an existing file is replaced only with --force. A LoRA run (lora.enabled)
exports its adapters as a PEFT directory (--peft: adapter_config.json + adapter_model.safetensors, which
peft.PeftModel.from_pretrained loads onto the base's Hugging Face model), or folded into its base (--merge) for
--hf, --safetensors and --gguf.

From Python:

    from quillgpt.hf import export_hf
    from quillgpt.loading import load_model, write_safetensors
    loaded = load_model("checkpoints/base")
    write_safetensors(loaded.model, loaded.tokenizer, "exports/base.safetensors")
    export_hf(loaded.model, loaded.tokenizer, "exports/base-hf")
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model import GPT
from quillgpt import gguf_export, hf, peft_io
from quillgpt.errors import UserError, run_main
from quillgpt.families import export_family
from quillgpt.loading import Loaded, load_model, write_safetensors
from quillgpt.lora import merged

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
    p.add_argument(
        "--gguf", metavar="OUT", help="write a GGUF file for llama.cpp and Ollama, and OUT's Modelfile beside it"
    )
    p.add_argument(
        "--outtype",
        default="f16",
        help=f"GGUF weights: {', '.join(gguf_export.OUTTYPES)} (default f16; vectors and norms stay f32; q4_0 keeps "
        "the output head at q8_0)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing --gguf file and its Modelfile")
    p.add_argument(
        "--peft",
        metavar="OUT_DIR",
        help="a LoRA run: write its adapters as a PEFT directory (adapter_config.json, adapter_model.safetensors)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: fold its adapters into its base for --hf, --safetensors, --gguf",
    )
    args = p.parse_args(argv)
    if not args.hf and not args.safetensors and not args.gguf and not args.peft:
        p.error("give --hf OUT_DIR, --safetensors OUT.safetensors, --gguf OUT.gguf and/or --peft OUT_DIR")
    return args


def model_to_export(loaded: Loaded, merge: bool, full: bool) -> GPT:
    """The model --hf, --safetensors and --gguf write: a LoRA run's merged (--merge), anything else as it is. full:
    one of them is asked for."""
    if loaded.lora is None:
        if merge:
            raise UserError(f"{loaded.source} has no adapters to merge: --merge and --peft are for LoRA runs")
        return loaded.model
    if full and not merge:
        raise UserError(
            f"{loaded.source} is a LoRA run: export it with its adapters folded into its base (--merge), or the "
            "adapters alone as a PEFT directory (--peft DIR)"
        )
    return merged(loaded.model) if full else loaded.model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gguf:  # refuse before reading the model
        gguf_export.check_outtype(args.outtype)
        gguf_export.check_target(args.gguf, args.force)
    loaded = load_model(args.ckpt, keep_adapters=True)
    if args.peft and loaded.lora is None:
        raise UserError(f"{loaded.source} has no adapters: --peft and --merge are for LoRA runs (lora.enabled)")
    if args.peft:
        peft_io.check_family(loaded.model.config, loaded.source)
    model = model_to_export(loaded, args.merge, bool(args.hf or args.safetensors or args.gguf))
    tokenizer, source = loaded.tokenizer, loaded.source
    if args.hf:  # refuse before writing anything
        export_family(model.config, str(source), tokenizer)
    if args.gguf:
        plan = gguf_export.plan_gguf(model, tokenizer, args.outtype, str(source))
    if args.safetensors:
        write_safetensors(model, tokenizer, args.safetensors)
        print(f"wrote {args.safetensors}")
    if args.hf:
        for note in hf.export_hf(model, tokenizer, args.hf, str(source)):
            print(f"note: {note}", file=sys.stderr)
        print(f"wrote {args.hf} (load it with transformers.AutoModelForCausalLM.from_pretrained)")
    if args.gguf:
        modelfile = gguf_export.write_gguf(model, plan, args.gguf, gguf_export.model_name(str(source)))
        size = Path(args.gguf).stat().st_size / 1e6
        print(
            f"wrote {args.gguf} ({hf.NAMES[plan.family]}, {args.outtype}, {size:.1f} MB) and {modelfile} "
            f"(ollama create NAME -f {modelfile})"
        )
    if args.peft:
        peft_io.write_peft(loaded.model, args.peft, loaded.lora["base"]["source"], source)
        print(f"wrote {args.peft} (load it with peft.PeftModel.from_pretrained(base, {args.peft!r}))")
    return 0


if __name__ == "__main__":
    run_main(main)

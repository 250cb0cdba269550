"""Score a model where runs are compared: bits per byte on text, HellaSwag, lm-evaluation-harness tasks, chat tasks.

    python eval.py --ckpt checkpoints/shakespeare-char-cpu               # its dataset's val split, bits per byte first
    python eval.py --ckpt checkpoints/base --text path/to/input.txt --stride 32 --map-unknown
    python eval.py --ckpt exports/base.safetensors --text docs.jsonl notes/ --data data/pystdlib --split val
    python eval.py --ckpt path/to/hf-gpt2 --hellaswag hellaswag_val.jsonl --limit 1000
    python eval.py --ckpt path/to/hf-gpt2 --hellaswag                    # downloads it once (hash-checked)
    python eval.py --ckpt checkpoints/base --core --max-per-task 500     # DCLM's CORE as nanochat computes it
    python eval.py --ckpt checkpoints/base --tasks hellaswag,arc_easy,lambada_openai   # the harness: '.[eval]'
    python eval.py --ckpt checkpoints/chat --tasks my_task --task-dir my_tasks/ --apply-chat-template   # chat mode
    python eval.py --ckpt checkpoints/chat --chat-task arithmetic,reverse,count --chat-items 200  # answers graded
    python eval.py --ckpt checkpoints/chat --chat-eval arc_easy,mmlu,gsm8k,humaneval --eval-data evals/ --max-per-task 200
    python eval.py --ckpt X --split val --hellaswag h.jsonl --json results.json        # every figure, traceable

--ckpt takes a checkpoint file, a run directory (its best checkpoint), a .safetensors file from
export.py, or a Hugging Face model directory (GPT-2, Llama, Qwen2, Qwen3) or hub name. A model with
a long context scores windows of at most --context tokens (default 2048). Text is read as prepare.py reads it (a text file,
.jsonl(.gz/.zst), .parquet, a directory; --text-field). How each figure is computed: quillgpt/scoring.py
(bits per byte, HellaSwag) and quillgpt/lm_harness.py (lm-evaluation-harness). --json writes every figure with
the checkpoint, the sha256 of each file scored and the settings, so that a number in a README can be
traced to its run.

--chat-task asks the held-out items of the synthetic chat tasks (quillgpt/tasks.py) and grades the greedy answers:
a model with a chat template in it (a reply ends at its end-of-turn token), a base model in a plain few-shot form
("Q: ...\nA: ..."), so that a base model and its fine-tuned chat model answer the same items (docs/chat.md).

--chat-eval scores a chat model on nanochat's chat evaluations as nanochat scores them (quillgpt/chat_eval.py): ARC and
MMLU by the answer letter's logit, GSM8K by its "#### N", HumanEval by its tests, run in quillgpt/sandbox.py.

--core scores DCLM's CORE over nanochat's eval_bundle as nanochat's base_eval.py does (quillgpt/core_eval.py): each
task's accuracy, centred on its random baseline, and their mean; GPT-2 (1.5B) scores 0.2565.
"""

from __future__ import annotations

import argparse
import sys

from quillgpt.errors import run_main
from quillgpt.evaluate import DEFAULT_CONTEXT, EvalRequest, evaluate, print_report
from quillgpt.files import atomic_write_json
from quillgpt.generate import DEVICES, pick_device
from quillgpt.tasks import parse_tasks


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, EvalRequest]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt", required=True, help="checkpoint, run directory, .safetensors file, or HF model directory or hub name"
    )
    p.add_argument(
        "--context",
        type=int,
        default=DEFAULT_CONTEXT,
        help=f"score with at most this many tokens of context (default {DEFAULT_CONTEXT}, or the model's if shorter)",
    )
    p.add_argument(
        "--text",
        nargs="+",
        action="extend",
        metavar="PATH",
        help="text files, .jsonl/.parquet documents or directories",
    )
    p.add_argument("--text-field", default="text", help="the records' text field (default: text)")
    p.add_argument(
        "--split", choices=("train", "val"), help="a prepared split (default: val, when nothing else is asked)"
    )
    p.add_argument("--data", metavar="DIR", help="the prepared dataset of --split (default: the checkpoint's)")
    p.add_argument("--stride", type=int, default=None, help="tokens a window moves on (default: half the context)")
    p.add_argument(
        "--hellaswag",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="HellaSwag's validation jsonl (no FILE: downloaded once into data/hellaswag/)",
    )
    p.add_argument(
        "--core",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="DCLM's CORE as nanochat computes it, over DIR, an unpacked eval_bundle (no DIR: $QUILLGPT_EVAL_BUNDLE, "
        "else data/eval_bundle, downloaded there once); --max-per-task N: the first N of each task's seeded shuffle",
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        action="extend",
        help="lm-evaluation-harness tasks, space- or comma-separated, or one --tasks each (needs '.[eval]')",
    )
    p.add_argument("--task-dir", help="a directory of harness task YAML files of your own")
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="harness tasks: put each request in the model's chat template (the harness's chat mode)",
    )
    p.add_argument("--num-fewshot", type=int, default=None, help="harness tasks: few-shot examples")
    p.add_argument("--limit", type=int, default=None, help="score at most this many HellaSwag items (and harness docs)")
    p.add_argument(
        "--chat-task",
        metavar="TASKS",
        help="synthetic chat tasks to answer and grade, comma-separated: arithmetic, reverse, count",
    )
    p.add_argument("--chat-items", type=int, default=100, help="held-out items of each chat task (default 100)")
    p.add_argument(
        "--chat-eval",
        metavar="TASKS",
        help="nanochat's chat evaluations, comma-separated: arc_easy, arc_challenge, mmlu, gsm8k, humaneval",
    )
    p.add_argument(
        "--eval-data",
        metavar="DIR",
        help="--chat-eval's data: DIR/<task>.jsonl or .parquet, the hub datasets' columns (default: from the hub, "
        "downloaded once into data/chat_eval/)",
    )
    p.add_argument(
        "--max-per-task", type=int, default=None, metavar="N", help="score at most N items of each task (default: all)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=512,
        help="tokens a generated --chat-eval reply (gsm8k, humaneval) may take (default 512, nanochat's)",
    )
    p.add_argument(
        "--map-unknown",
        action="store_true",
        help="score characters a char model has never seen as a stand-in character instead of stopping",
    )
    p.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: cuda, else mps, else cpu)")
    p.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="autocast precision (default auto: bf16 on a CUDA device that has it; on the CPU the faster of fp32 and "
        "bf16 at the model's shape, measured)",
    )
    p.add_argument("--json", metavar="FILE", help="write every figure, the checkpoint, data hashes and settings here")
    args = p.parse_args(argv)
    harness_tasks = [t for given in args.tasks or [] for t in given.split(",") if t]
    asked = (args.text, args.split, args.hellaswag is not None, args.core is not None, harness_tasks, args.chat_task)
    if not (any(asked) or args.chat_eval):
        args.split = "val"
    if args.limit is not None and args.limit < 1:
        p.error("--limit must be at least 1")
    chat_tasks = parse_tasks(args.chat_task) if args.chat_task else []  # an unknown name stops here, before loading
    if args.chat_items < 1:
        p.error("--chat-items must be at least 1")
    chat_eval = []
    if args.chat_eval:
        from quillgpt.chat_eval import parse_names

        chat_eval = parse_names(args.chat_eval)  # an unknown name stops here, too
    if args.max_per_task is not None and args.max_per_task < 1:
        p.error("--max-per-task must be at least 1")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if args.apply_chat_template and not args.tasks:
        p.error("--apply-chat-template is for harness tasks: give --tasks")
    if args.context < 2:
        p.error("--context must be at least 2")
    device = pick_device(args.device)  # a device this machine lacks: one line, before anything loads
    return args, EvalRequest(
        ckpt=args.ckpt,
        text=tuple(args.text or ()),
        text_field=args.text_field,
        split=args.split,
        data=args.data,
        context=args.context,
        stride=args.stride,
        hellaswag=args.hellaswag,
        core=args.core,
        tasks=tuple(harness_tasks),
        task_dir=args.task_dir,
        apply_chat_template=args.apply_chat_template,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        chat_tasks=tuple(chat_tasks),
        chat_items=args.chat_items,
        chat_eval=tuple(chat_eval),
        eval_data=args.eval_data,
        max_per_task=args.max_per_task,
        max_new_tokens=args.max_new_tokens,
        map_unknown=args.map_unknown,
        device=str(device),
        precision=args.precision,
    )


def main(argv: list[str] | None = None) -> int:
    args, request = parse_args(argv)
    print(f"[evaluating {args.ckpt} on {request.device}]", file=sys.stderr, flush=True)
    report = evaluate(request)
    print_report(report)
    if args.json:
        atomic_write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)

"""Chat with a model fine-tuned on conversations (or any model whose tokenizer has a chat template).

    python chat.py --ckpt checkpoints/chat                                  # interactive, streamed
    python chat.py --ckpt checkpoints/chat --system "You answer briefly." --temperature 0.7 --top-p 0.9
    python chat.py --ckpt checkpoints/chat --prompt "What is 17 + 25?"     # one answer, for scripts
    python chat.py --ckpt path/to/hf-qwen2.5-0.5b-instruct --dtype bf16    # a Hugging Face chat model

In a conversation: /reset starts a new one, /system TEXT starts a new one with that system message, /quit (or
end of input) leaves. The KV cache is kept across turns, so each turn reads only the new text; a reply ends at the
template's end-of-turn token or after --max-new-tokens. When the conversation outgrows the model's context, the
oldest turns are dropped, with a notice on stderr. On a terminal, lines typed are kept in ~/.quillgpt_chat_history.
How it works: quillgpt/chat_session.py; the chat template: quillgpt/chat_template.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from quillgpt.chat_session import ChatSession
from quillgpt.errors import UserError, run_main
from quillgpt.generate import COMPILE_HELP, DEVICES, DTYPES, load_for_sampling, sampling_error

HISTORY = Path.home() / ".quillgpt_chat_history"
HELP = "/reset: a new conversation | /system TEXT: a new one with this system message | /quit: leave"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ckpt",
        required=True,
        help="checkpoint file, run directory, .safetensors file, or Hugging Face model directory or hub name",
    )
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--prompt", default=None, help="answer this one message and exit")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = off")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, e.g. 0.9")
    p.add_argument("--seed", type=int, default=None, help="make the replies repeatable")
    p.add_argument(
        "--control-tokens-in-content",
        action="store_true",
        help="text you type that spells a control token (<|im_end|>, ...) becomes that token, as in transformers' "
        "apply_chat_template (default: it is encoded as text)",
    )
    p.add_argument("--device", default="auto", help=f"{DEVICES} (default auto: cuda, else mps, else cpu)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights' dtype (default auto, as sample.py: bf16 on a CUDA device that has it, on the CPU bf16 where "
        "decoding measures clearly faster in it); int8: weight-only int8 on the CPU",
    )
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help=COMPILE_HELP)
    p.add_argument("--verbose", action="store_true", help="print the decoding plan: precision, step, products, and why")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")
    if why := sampling_error(args.temperature, args.top_p, args.top_k, args.seed):
        p.error(why)
    return args


def read_line(tty: bool) -> str | None:
    """The next line typed (None at end of input), with readline's editing and history on a terminal."""
    try:
        return input("you> " if tty else "")
    except EOFError:
        if tty:
            print()
        return None


def start_history() -> None:
    import atexit
    import readline

    try:
        readline.read_history_file(HISTORY)
    except OSError:  # none yet, or unreadable: start a new one
        pass
    readline.set_history_length(1000)
    atexit.register(save_history, readline)


def save_history(readline) -> None:
    try:
        readline.write_history_file(HISTORY)
    except OSError as e:
        print(f"[could not save the chat history to {HISTORY}: {e.strerror}]", file=sys.stderr)


def converse(session: ChatSession, args: argparse.Namespace, generator: torch.Generator) -> None:
    tty = sys.stdin.isatty()
    if tty:
        start_history()
        print(f"[{HELP}]", file=sys.stderr)
    while (line := read_line(tty)) is not None:
        command, _, rest = line.strip().partition(" ")
        if command == "/quit":
            return
        if command == "/reset":
            session.reset(session.system)
            print("[a new conversation]", file=sys.stderr)
        elif command == "/system":
            session.reset(rest.strip())
            print(f"[a new conversation, system message: {rest.strip() or '(none)'}]", file=sys.stderr)
        elif command.startswith("/"):
            print(f"[unknown command {command}: {HELP}]", file=sys.stderr)
        elif line.strip():
            answer(session, line, args, generator)


def answer(session: ChatSession, text: str, args: argparse.Namespace, generator: torch.Generator) -> None:
    try:
        session.reply(text, args.temperature, args.top_k or None, args.top_p, generator, stream=sys.stdout)
    except UserError as e:  # a message too long for the context should not end the conversation
        print(f"error: {e}", file=sys.stderr)
        return
    print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, tokenizer, plan = load_for_sampling(args.ckpt, args.device, args.dtype, args.compile)
    if not tokenizer.chat_template:
        raise UserError(
            f"{args.ckpt} has no chat template (a base model): fine-tune it on conversations first (docs/chat.md), "
            "or continue text with sample.py"
        )
    print(f"[chatting with {plan.label}]", file=sys.stderr, flush=True)
    if args.verbose:
        print(plan.text(), file=sys.stderr, flush=True)
    session = ChatSession(
        model,
        tokenizer,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        control_tokens_in_content=args.control_tokens_in_content,
        plan=plan,
    )
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(args.seed if args.seed is not None else torch.seed())
    if args.prompt is not None:
        session.reply(args.prompt, args.temperature, args.top_k or None, args.top_p, generator, stream=sys.stdout)
        print()
        return 0
    converse(session, args, generator)
    return 0


if __name__ == "__main__":
    run_main(main)

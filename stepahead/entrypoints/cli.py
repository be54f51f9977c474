"""The `stepahead` command: generate, chat, and the subcommands other modules register (serve, bench, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Sequence

from stepahead.entrypoints.engine_flags import add_engine_args, engine_args_from_namespace
from stepahead.errors import StepaheadError
from stepahead.sampling_params import SamplingParams

# Modules that add a subcommand with add_parser(subparsers), which sets `func` on its parser.
_SUBCOMMAND_MODULES = (
    "stepahead.tools.simulate",
    "stepahead.entrypoints.openai.serve_cli",
    "stepahead.bench.cli",
)


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens to generate (default: %(default)s)")
    # Unset: the model's generation_config.json value (see --generation-config), else vLLM's default.
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's, or 1.0)")
    group.add_argument("--top-p", type=float, default=None, help="(default: the model's, or 1.0)")
    group.add_argument("--top-k", type=int, default=None, help="0 or -1: off (default: the model's, or off)")
    # --seed is the engine flag (add_engine_args); it seeds the request's sampling too.


def sampling_params_from_namespace(ns: argparse.Namespace, n: int = 1, seeded: bool = True,
                                   defaults: SamplingParams | None = None) -> SamplingParams:
    """The flags given, over `defaults` (the model's, from LLM.get_default_sampling_params).
    seeded: the request samples with --seed (one-shot generate is reproducible on its own)."""
    base = defaults or SamplingParams()
    given = {name: getattr(ns, name) for name in ("temperature", "top_p", "top_k") if getattr(ns, name) is not None}
    return dataclasses.replace(base, n=n, max_tokens=ns.max_tokens, seed=ns.seed if seeded else None, **given)


def _make_llm(ns: argparse.Namespace):
    from stepahead.engine.arg_utils import EngineArgs
    from stepahead.engine.llm import LLM

    args = engine_args_from_namespace(ns)
    return LLM(**{name: getattr(args, name) for name in EngineArgs.field_names()})


def run_generate(ns: argparse.Namespace) -> int:
    sampling_params_from_namespace(ns, n=ns.n)  # bad flags fail before the model loads
    with _make_llm(ns) as llm:
        params = sampling_params_from_namespace(ns, n=ns.n, defaults=llm.get_default_sampling_params())
        use_chat = ns.chat if ns.chat is not None else getattr(llm.get_tokenizer(), "chat_template", None) is not None
        prompt = llm.apply_chat_template([{"role": "user", "content": ns.prompt}]) if use_chat else ns.prompt
        (request_output,) = llm.generate(prompt, params, use_tqdm=False)
        for completion in request_output.outputs:
            if len(request_output.outputs) > 1:
                print(f"--- completion {completion.index} ({completion.finish_reason})")
            print(completion.text)
    return 0


def run_chat(ns: argparse.Namespace) -> int:
    """Interactive chat: stream each reply as it is generated; the conversation is kept as history."""
    # Not seeded per request: each turn would draw the same noise. The engine seed keeps a
    # whole session reproducible.
    sampling_params_from_namespace(ns, seeded=False)  # bad flags fail before the model loads
    with _make_llm(ns) as llm:
        params = sampling_params_from_namespace(ns, seeded=False, defaults=llm.get_default_sampling_params())
        history: list[dict[str, str]] = []
        if ns.system:
            history.append({"role": "system", "content": ns.system})
        print("Type a message; /exit or Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            if line.strip() == "/exit":
                return 0
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            reply = []
            try:
                for delta in llm.generate_stream(llm.apply_chat_template(history), params):
                    text = delta.outputs[0].text
                    reply.append(text)
                    print(text, end="", flush=True)
            except KeyboardInterrupt:
                print(" [interrupted]", end="")
            print()
            history.append({"role": "assistant", "content": "".join(reply)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stepahead", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = subparsers.add_parser("generate", help="generate a completion for one prompt and print it")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("-n", type=int, default=1, help="completions to generate (default: %(default)s)")
    # An instruct model given a bare question often ends its turn at once: chat is the useful default.
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="send the prompt as a user message through the model's chat template "
                          "(default: when the tokenizer has one; --no-chat: a raw completion)")
    add_sampling_args(gen, max_tokens=128)
    add_engine_args(gen, positional_model=False)
    gen.set_defaults(func=run_generate)

    chat = subparsers.add_parser("chat", help="interactive chat with streamed replies")
    chat.add_argument("--system", default=None, help="a system message that starts the conversation")
    add_sampling_args(chat, max_tokens=256)
    add_engine_args(chat, positional_model=True)
    chat.set_defaults(func=run_chat)

    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns) or 0)
    except ValueError as e:  # bad input (InvalidInputError among them): flags, prompt, model folder
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StepaheadError as e:  # the engine or its worker failed; any other error is a bug
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

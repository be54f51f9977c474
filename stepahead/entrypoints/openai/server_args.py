"""The OpenAI-compatible server's flags: server ones here, engine ones shared with every subcommand.

Read by both `stepahead serve` (serve_cli.py) and `python -m stepahead.entrypoints.openai.api_server`.
"""

from __future__ import annotations

import argparse

from stepahead.entrypoints.engine_flags import add_engine_args
from stepahead.entrypoints.openai.reasoning import REASONING_PARSERS
from stepahead.entrypoints.openai.request_limits import DEFAULT_MAX_REQUEST_BYTES
from stepahead.entrypoints.openai.responses_input import DEFAULT_MAX_STORED_RESPONSES
from stepahead.entrypoints.openai.tool_calling.parsers import TOOL_PARSERS

DESCRIPTION = "OpenAI-compatible HTTP server"


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_engine_args(parser, positional_model=True, exclude={"trace"})
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one "
                       "(default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1/* (default: $STEPAHEAD_API_KEY)")
    group.add_argument("--shutdown-timeout", type=float, default=0.0,
                       help="on SIGINT/SIGTERM, drain in-flight requests for up to this many seconds; "
                            "0 aborts them (default: %(default)s)")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="larger request bodies get a 413 (default: %(default)s)")
    group.add_argument("--max-sequences-per-request", type=int, default=None,
                       help="most sequences (prompts x n) one request may ask for (default: 4 x --max-num-seqs, "
                            "at least 128)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat template (chat_template, or chat_template_kwargs' "
                            "chat_template); refused by default: a template is code the server runs")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide on tool calls (tool_choice "auto", the default with tools), '
                            "found in its output by --tool-call-parser")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="how the model writes tool calls, for --enable-auto-tool-choice (hermes: Qwen 2.5/3, "
                            "Hermes; llama3_json: Llama 3.x; mistral: Mistral, Magistral; qwen3_coder or qwen3_xml: "
                            "Qwen3-Coder's XML; pythonic: Llama 3.2 and 4's Python list; phi4_mini_json: Phi-4-mini); "
                            "refused at start when the tokenizer lacks the format's own tokens")
    group.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="split the model's reasoning into reasoning_content on chat completions (deepseek_r1: "
                            "<think>...</think>, opened by the template; qwen3: opened by the output; mistral: "
                            "[THINK]...[/THINK]; seed_oss: <seed:think>...</seed:think>); refused at start when the "
                            "tokenizer cannot write both markers as single tokens")
    group.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                       help="/v1/responses kept in memory for previous_response_id; the oldest goes first "
                            "(default: %(default)s)")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help='logprobs name tokens "token_id:N" unless a request says otherwise (its '
                            "return_tokens_as_token_ids field)")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load counts the generation requests in progress, from arrival to the last byte of "
                            "the response (vLLM's server_load; 0 without this flag)")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info: the tokenizer's configuration, chat template included")
    group.add_argument("--metrics-prefix", choices=["stepahead", "vllm"], default="stepahead",
                       help="the prefix of /metrics' families: 'vllm' serves them under vLLM's own names "
                            "(vllm:...), for dashboards built for vLLM (default: %(default)s)")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    # Instead of the engine's --trace switch: a file to write the trace to at shutdown.
    group.add_argument("--trace", dest="trace_file", default=None, metavar="FILE.json",
                       help="record engine and worker events and write a Chrome trace there on shutdown")
    return parser


def make_parser() -> argparse.ArgumentParser:
    return add_server_args(argparse.ArgumentParser(prog="stepahead serve", description=DESCRIPTION))

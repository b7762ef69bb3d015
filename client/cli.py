"""``nanoserve``: generate, chat and inspect a nanoserve scheduler from the terminal.

Exit codes: 0 success; 1 other server error, a generation the server aborted, or ``health`` not
SERVING; 2 bad command line;
3 server unreachable or timed out; 4 request rejected (invalid argument); 5 server busy
(queue full); 130 interrupted. ``replay`` has its own (docs/replay.md).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import asdict

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from client.api import DEFAULT_TARGET, Client
from client.errors import NanoserveError
from client.replay import run_replay
from common import replay_cli
from common.replay_cli import add_arguments as add_replay_arguments
from common.security import TLSConfig

EXIT_ERROR = 1
EXIT_UNAVAILABLE = 3
EXIT_REJECTED = 4
EXIT_BUSY = 5
EXIT_INTERRUPTED = 130
EXIT_CODES = {
    grpc.StatusCode.UNAVAILABLE: EXIT_UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: EXIT_UNAVAILABLE,
    grpc.StatusCode.INVALID_ARGUMENT: EXIT_REJECTED,
    grpc.StatusCode.OUT_OF_RANGE: EXIT_REJECTED,
    grpc.StatusCode.FAILED_PRECONDITION: EXIT_REJECTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: EXIT_BUSY,
}


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("NANOSERVE_SERVER", DEFAULT_TARGET),
                        help="scheduler address HOST:PORT, several as H1:P1,H2:P2 or dns:///NAME:PORT, balanced "
                             "round-robin; a stream whose scheduler dies resumes on another "
                             "(env NANOSERVE_SERVER, default %(default)s)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the call is abandoned")
    parser.add_argument("--api-key", default=os.environ.get("NANOSERVE_API_KEY"),
                        help="sent as 'authorization: Bearer <key>' (default: env NANOSERVE_API_KEY)")
    parser.add_argument("--tls-ca", default=os.environ.get("NANOSERVE_SERVER_CA"),
                        help="connect with TLS, verifying the server with this PEM CA (env NANOSERVE_SERVER_CA)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a server that requires one")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")


def add_generation_args(parser: argparse.ArgumentParser) -> None:
    add_connection_args(parser)
    # Unset options are not sent; "server default" is what the scheduler then applies (tests/test_defaults.py).
    parser.add_argument("--max-tokens", type=int,
                        help="completion tokens at most (server default 256, capped by the model length)")
    parser.add_argument("--max-tokens-to-room", action="store_true", default=None,
                        help="without --max-tokens: up to the room the prompt leaves in the model length, as vLLM's "
                             "chat completions (server default false: 256)")
    parser.add_argument("--cap-max-tokens-to-room", action="store_true", default=None,
                        help="a --max-tokens beyond the room the prompt leaves in the model length is that room, as "
                             "vLLM's Responses API takes max_output_tokens (server default false: refused)")
    parser.add_argument("--temperature", type=float, help="0 is greedy (server default 1.0)")
    parser.add_argument("--top-p", type=float, help="nucleus mass in (0, 1] (server default 1.0)")
    parser.add_argument("--top-k", type=int, help="keep the k most likely tokens, 0 disables (server default 0)")
    parser.add_argument("--min-p", type=float, help="relative probability floor in [0, 1] (server default 0.0)")
    parser.add_argument("--seed", type=int, help="the same seed gives the same tokens (server default none)")
    parser.add_argument("--stop", action="append",
                        help="a string that ends the generation, repeatable (server default none)")
    parser.add_argument("--stop-token-id", dest="stop_token_ids", type=int, action="append",
                        help="a token id that ends the generation, repeatable (server default none)")
    parser.add_argument("--ignore-eos", action="store_true", default=None,
                        help="keep going past EOS (server default false)")
    parser.add_argument("--logprobs", type=int,
                        help="with --json: logprobs of this many top tokens (server default none)")
    parser.add_argument("--repetition-penalty", type=float,
                        help="> 1 discourages tokens already in the prompt or completion (server default 1.0)")
    parser.add_argument("--presence-penalty", type=float,
                        help="in [-2, 2], against tokens the completion holds (server default 0.0)")
    parser.add_argument("--frequency-penalty", type=float,
                        help="in [-2, 2], against tokens by their count in the completion (server default 0.0)")
    parser.add_argument("--logit-bias", type=logit_bias, action="append",
                        help="TOKEN_ID=BIAS added to that token's logit, repeatable (server default none)")
    parser.add_argument("--lora", metavar="NAME", help="the LoRA adapter to run through (server default: the base "
                        "model; 'nanoserve info' lists the adapters)")
    parser.add_argument("--priority", type=int, help="lower is admitted first and preempted last, where the scheduler "
                        "runs --request-order priority (server default 0; only 0 otherwise)")
    parser.add_argument("--cache-salt", help="salt the prefix cache: the prompt hits only blocks computed for "
                        "requests of the same salt (server default: unsalted)")
    parser.add_argument("--thinking-token-budget", type=int, help="the most tokens the model may think before "
                        "</think> is forced (-1: none; the server needs --reasoning-parser; server default none)")
    parser.add_argument("--n", type=int, help="independent completions, streamed labelled by index (server default 1)")
    parser.add_argument("--min-tokens", type=int,
                        help="completion tokens before EOS or a stop may end it (server default 0)")
    parser.add_argument("--include-stop-str-in-output", action="store_true", default=None,
                        help="keep the matched stop string in the text (server default false)")
    parser.add_argument("--keep-special-tokens", dest="skip_special_tokens", action="store_false", default=None,
                        help="show special tokens in the text (server default true: skip_special_tokens)")
    parser.add_argument("--truncate-prompt-tokens", type=int,
                        help="keep only the last N prompt tokens; -1: the model length less one (server default none)")
    parser.add_argument("--truncation-side", choices=("left", "right"),
                        help="right: --truncate-prompt-tokens keeps the first tokens instead (server default left)")
    parser.add_argument("--logprob-token-id", dest="logprob_token_ids", type=int, action="append",
                        help="with --json: the alternatives each token's logprobs list are these tokens', repeatable "
                             "(server default: the most likely)")
    parser.add_argument("--repetition-detection", type=repetition_detection, metavar="MAX,COUNT[,MIN]",
                        help="end once the last tokens repeat a pattern of MIN (default 1) to MAX tokens COUNT times "
                             "in a row, finish reason repetition (vLLM's repetition_detection; server default off)")
    parser.add_argument("--prompt-logprobs", type=int,
                        help="with --json: each prompt token's logprob and N top alternatives (server default none)")
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", type=file_text, metavar="FILE",
                            help="the output validates against this JSON Schema file (server default none)")
    constraint.add_argument("--regex", help="the whole output matches this regular expression (server default none)")
    constraint.add_argument("--choice", action="append",
                            help="the output is exactly one of these strings, repeatable (server default none)")
    constraint.add_argument("--grammar", type=file_text, metavar="FILE",
                            help="the output parses with this Lark (or GBNF) grammar file (server default none)")
    constraint.add_argument("--json-object", action="store_true", default=None,
                            help="the output is a JSON object (server default false)")
    parser.add_argument("--return-prompt-token-ids", action="store_true", default=None,
                        help="with --json: the prompt's token ids as the model reads them (server default false)")
    parser.add_argument("--grammar-from-first-token", action="store_true", default=None,
                        help="with a constraint: apply it from the first token, not after the thinking the server's "
                             "--reasoning-parser waits for (server default false)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, token_ids, finish_reason, usage) instead of streaming")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete a text prompt")
    add_generation_args(generate)
    generate.add_argument("prompt", nargs="?", help="the prompt text, or - to read it from stdin")
    generate.add_argument("--token-ids", type=token_ids,
                          help="the prompt as comma-separated token ids instead of text, e.g. 1,2,3")
    chat = commands.add_parser("chat", help="answer one user message with the model's chat template")
    add_generation_args(chat)
    chat.add_argument("--system", help="a system message placed before the user's")
    chat.add_argument("message", help="the user's message, or - to read it from stdin")
    tokenize = commands.add_parser("tokenize", help="print a text's token ids as JSON")
    add_connection_args(tokenize)
    tokenize.add_argument("text", help="the text, or - to read it from stdin")
    tokenize.add_argument("--no-special-tokens", dest="add_special_tokens", action="store_false", default=None,
                          help="do not add the tokenizer's special tokens (BOS)")
    detokenize = commands.add_parser("detokenize", help="print the text of comma-separated token ids")
    add_connection_args(detokenize)
    detokenize.add_argument("token_ids", type=token_ids, help="e.g. 1,2,3")
    abort = commands.add_parser("abort", help="abort requests in flight by id; print those aborted")
    add_connection_args(abort)
    abort.add_argument("request_ids", nargs="+", help="request ids (GenerateRequest.request_id)")
    add_replay_arguments(commands.add_parser(
        "replay", help="drive an executor with a scheduler's recording and compare its results (docs/replay.md)",
        description=replay_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    for name, text in (("info", "print the served model and its limits as JSON"),
                       ("stats", "print the scheduler's live counters as JSON"),
                       ("health", "print the grpc.health.v1 status; exit 0 only when SERVING")):
        add_connection_args(commands.add_parser(name, help=text))
    return parser


def token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def logit_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 42=-100, got {text!r}") from None


def repetition_detection(text: str) -> dict[str, int]:
    """MAX,COUNT[,MIN] as vLLM's repetition_detection."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected MAX,COUNT[,MIN] (whole numbers), got {text!r}")
    return dict(zip(("max_pattern_size", "min_count", "min_pattern_size"), values, strict=False))


def file_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from None


def generation_options(args: argparse.Namespace) -> dict:
    names = ("max_tokens", "max_tokens_to_room", "cap_max_tokens_to_room", "temperature", "top_p", "top_k", "min_p",
             "seed", "stop",
             "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty",
             "n", "min_tokens", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
             "truncation_side",
             "prompt_logprobs", "json_schema", "regex", "choice", "grammar", "json_object", "grammar_from_first_token",
             "lora", "priority", "return_prompt_token_ids", "cache_salt", "thinking_token_budget", "logprob_token_ids",
             "repetition_detection")
    options = {name: getattr(args, name) for name in names}
    options["logit_bias"] = dict(args.logit_bias) if args.logit_bias else None
    return options


def read_text(value: str) -> str:
    return sys.stdin.read() if value == "-" else value


def run_generation(client: Client, args: argparse.Namespace, prompt: dict) -> int:
    """Stream text to stdout as it arrives, or print one JSON object with ``--json``."""
    options = generation_options(args) | prompt
    several = (args.n or 1) > 1
    if args.json:
        completions = client.choices(**options) if several else [client.generate(**options)]
        for completion in completions:
            print(json.dumps({
                **({"index": completion.index} if several else {}),
                "text": completion.text,
                "token_ids": completion.token_ids,
                "finish_reason": completion.finish_reason,
                "usage": asdict(completion.usage) if completion.usage else None,
                **({"logprobs": [asdict(lp) for lp in completion.logprobs]}
                   if args.logprobs is not None or args.logprob_token_ids else {}),
                **({"prompt_logprobs": [asdict(lp) for lp in completion.prompt_logprobs]}
                   if args.prompt_logprobs is not None else {}),
                **({"prompt_token_ids": completion.prompt_token_ids} if args.return_prompt_token_ids else {}),
            }))
        reasons = [completion.finish_reason for completion in completions]
    elif several:
        # Choices interleave as the server decodes them: one line per piece, labelled.
        reasons = []
        for chunk in client.stream(**options):
            if chunk.text:
                print(f"[{chunk.index}] {chunk.text!r}", flush=True)
            if chunk.finish_reason:
                reasons.append(chunk.finish_reason)
                print(f"[{chunk.index}] finished: {chunk.finish_reason}", flush=True)
    else:
        reasons = []
        for chunk in client.stream(**options):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            reasons = [chunk.finish_reason]
        sys.stdout.write("\n")
    if "abort" in reasons:
        # The stream does not say which: an Abort call (from any client) or a shutdown look the same here.
        print("error: ABORTED: the server aborted the generation (an Abort call, or its shutdown)", file=sys.stderr)
        return EXIT_ERROR
    return 0


def run(args: argparse.Namespace, tls: TLSConfig | None) -> int:
    with Client(args.server, timeout=args.timeout, api_key=args.api_key, tls=tls) as client:
        if args.command == "generate":
            prompt = {"token_ids": args.token_ids} if args.token_ids else {"prompt": read_text(args.prompt)}
            return run_generation(client, args, prompt)
        if args.command == "chat":
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": read_text(args.message)})
            return run_generation(client, args, {"messages": messages})
        if args.command == "tokenize":
            token_ids = client.tokenize(read_text(args.text), add_special_tokens=args.add_special_tokens)
            print(json.dumps({"token_ids": token_ids, "count": len(token_ids)}))
            return 0
        if args.command == "detokenize":
            print(client.detokenize(args.token_ids))
            return 0
        if args.command == "abort":
            print(json.dumps({"aborted_request_ids": client.abort(args.request_ids)}))
            return 0
        if args.command == "health":
            status = client.health()
            print(status)
            return 0 if status == "SERVING" else EXIT_ERROR
        message = client.model_info() if args.command == "info" else client.stats()
        print(json.dumps(message_to_json(message), indent=2))
        return 0


def message_to_json(message: Message) -> dict:
    """Every field by its proto name in proto order, 64-bit counters as numbers (proto's JSON makes them strings)."""
    fields = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    wide = (FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT64)
    return {f.name: int(fields[f.name]) if f.cpp_type in wide else fields[f.name] for f in message.DESCRIPTOR.fields}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and (args.prompt is None) == (args.token_ids is None):
        parser.error("generate takes a PROMPT or --token-ids, not both or neither")
    try:
        tls = TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as e:
        parser.error(str(e))
    try:
        if args.command == "replay":
            argv = sys.argv[1:] if argv is None else argv
            return run_replay(args, tls, argv[argv.index("replay") + 1 :])
        return run(args, tls)
    except NanoserveError as e:
        sys.stdout.flush()
        print(f"error: {e.code.name}: {e.message}", file=sys.stderr)
        return EXIT_CODES.get(e.code, EXIT_ERROR)
    except socket.gaierror as e:  # a --server host that does not resolve
        print(f"error: UNAVAILABLE: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ValueError as e:  # an option the request cannot carry, or a malformed --server list
        parser.error(str(e))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())

"""Command-line flags of ``nanoserve-scheduler``; each can also come from ``NANOSERVE_<FLAG>``."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from common.channels import PUBLIC_MAX_MESSAGE_BYTES
from common.flags import (
    ENV_PREFIX,
    EnvFlags,
    boolean,
    byte_size,
    file_or_text,
    grpc_message_bytes,
    json_object,
    json_strings,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
    secret,
    share,
)
from scheduler_svc.api.http.chat_output import ChatParsing
from scheduler_svc.api.http.cors import Cors
from scheduler_svc.api.http.reasoning import REASONING_PARSERS
from scheduler_svc.api.http.tool_parsers import TOOL_PARSERS
from scheduler_svc.api.kv_events_config import kv_events_flag
from scheduler_svc.core.scheduler_config import (
    DEFAULT_NGRAM_SIZE,
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    POLICY_NAMES,
    REQUEST_ORDERS,
    SPECULATIVE_METHODS,
    SchedulerConfig,
)
from scheduler_svc.core.tokenizer import TEMPLATE_VARIABLES
from scheduler_svc.engine.recorder import DEFAULT_MAX_FILE_BYTES

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# vLLM's --generation-config values: "auto" takes the model's request defaults (generation_config.json), "vllm" not.
GENERATION_CONFIGS = ("auto", "vllm")


@dataclass(frozen=True)
class ServiceConfig:
    executor: str = "127.0.0.1:50052"
    host: str = "127.0.0.1"
    port: int = 50051
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Requests waiting to be scheduled (not yet running) before new ones are refused.
    max_queued_requests: int = 1024
    log_level: str = "INFO"
    # Prompt tokens of the requests waiting to be scheduled, before new ones are refused.
    max_queued_tokens: int = 1 << 20
    # Largest public-API message, each way.
    max_message_bytes: int = PUBLIC_MAX_MESSAGE_BYTES
    # Seconds one executor call may take before the executor counts as hung (and the scheduler recovers).
    step_timeout: float = 60.0
    # Seconds requests in flight get to finish on SIGTERM before they are aborted.
    shutdown_grace: float = 30.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    executor_tls_ca: str = ""
    executor_tls_cert: str = ""
    executor_tls_key: str = ""
    api_key: str = ""
    # Keep one step in flight: schedule step N+1 while the executor runs step N. None: on beside an accelerator, off
    # where the executor computes on the CPU, whose step the scheduler's work cannot hide behind and where an arrival
    # would wait for the step queued ahead too (W3: docs/benchmarks-history.md).
    overlap: bool | None = None
    # With overlap, how many plain steps the engine loop sends ahead of the one it waits for, when their outputs
    # cannot change the next plans. None: 2 beside an accelerator, where a plan that comes late (on a busy host)
    # still finds the device busy, 1 on the CPU; each adds a step before an arrival's prefill or a cancel takes effect.
    plans_ahead: int | None = None
    # The most decode steps per plan (multi-step scheduling): the executor feeds its own tokens in between. A plan
    # takes no more than any of its requests' readers take at a time (1 for a token-by-token stream), and an arrival
    # cuts one short. Plans are pipelined across windows (``Engine``), so 8 serves the CPU and an accelerator alike:
    # on the CPU it brings the split level with in-process, beside an accelerator it costs next to nothing against
    # one step per plan, and it helps where the executor's CPU per plan nears the device's step (W1, W5: the
    # figures are in docs/benchmarks-history.md).
    num_scheduler_steps: int = 8
    # "nano-vllm": prefill first, never mixed with decode (the seed's policy); "mixed": running decodes first, prefill
    # chunks fill the rest of the token budget in the same step (``core.mixed``).
    scheduling_policy: str = "nano-vllm"
    # "fcfs": requests are admitted (and preempted last) in arrival order; "priority": by GenerateRequest.priority,
    # lower first, then arrival (vLLM's --scheduling-policy priority; ``core.request_order``).
    request_order: str = "fcfs"
    # The most distinct LoRA adapters in one step; requests for another wait their turn, in arrival order.
    max_loras: int = 4
    # Tokens a stream gathers before a message goes out (the first and the last go at once): vLLM's and SGLang's
    # --stream-interval.
    stream_interval: int = 1
    # Serve the public gRPC API from a process of its own (``api.api_process``): the streams are written there, not
    # beside the engine loop.
    api_process: bool = True
    # The most of a core the API process spends writing streams before it holds a step's outputs back, so that each
    # message carries several tokens (``api.pacing``); 1: never held while a core can write them. None: a tenth
    # of the machine's cores, at most one (``pacing.default_share``).
    api_process_cpu_share: float | None = None
    # With an executor on the CPU, this process's threads run in SCHED_IDLE so that none preempts its forward pass
    # (throughput first: a request's first token comes later).
    yield_cpu: bool = False
    # The OpenAI-compatible HTTP API, on --host beside gRPC; 0 turns it off.
    http_port: int = 8000
    # Prometheus /metrics alone, asking no client certificate (for scrapers that cannot present one); 0 turns it off.
    metrics_port: int = 0
    # What a browser page of another origin may call on the HTTP API (vLLM's flags and defaults, ``Cors``).
    allowed_origins: tuple[str, ...] = Cors.origins
    allowed_credentials: bool = Cors.credentials
    allowed_methods: tuple[str, ...] = Cors.methods
    allowed_headers: tuple[str, ...] = Cors.headers
    # vLLM's --kv-events-config JSON: publish the prefix cache's events over ZMQ (``api.kv_events_config``).
    kv_events_config: str = ""
    # Record the executor's handshake, plans and results into this directory (docs/replay.md); "": no recording.
    record: str = ""
    # With --record: record from the start; off, only once StartRecording (gRPC or HTTP) asks.
    record_at_start: bool = True
    # Keep the tokenizer and chat template in the recorded handshakes (without them the ids are not text).
    record_text: bool = False
    # A recording file's size before the next one begins, in bytes.
    record_max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # Speculative decoding (docs/scheduler.md): "ngram" proposes from each request's own tokens, "draft" has the
    # executor's draft model propose; None: off. The rest are None unless given (``SchedulerConfig``'s defaults).
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    ngram_min: int | None = None
    ngram_max: int | None = None
    speculative_disable_by_batch_size: int | None = None
    # One of GENERATION_CONFIGS.
    generation_config: str = "auto"
    # vLLM's --served-model-name: the names a request's ``model`` may give the base model, the first reported as its
    # id everywhere; empty: the executor's model id alone.
    served_model_name: tuple[str, ...] = ()
    # vLLM's tool calling flags: tool_choice "auto" is taken only with both, its answers read for calls in the format
    # of --tool-call-parser (``api.http.tool_calls``); "required" and a named function need neither.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str = ""
    # vLLM's --reasoning-parser: a chat answer's thinking goes to the message's "reasoning" (``api.http.reasoning``).
    reasoning_parser: str = ""
    # vLLM's --enable-server-load-tracking: /load counts the generation requests the HTTP API is answering.
    enable_server_load_tracking: bool = False
    # vLLM's --enable-request-id-headers: every HTTP answer carries X-Request-Id.
    enable_request_id_headers: bool = False
    # vLLM's VLLM_SERVER_DEV_MODE: /reset_prefix_cache, /pause, /resume and /is_paused are served.
    server_dev_mode: bool = False
    # How many of /v1/responses' answers are kept for previous_response_id, retrieval and background mode.
    responses_store: int = ChatParsing.responses_store
    # vLLM's --return-tokens-as-token-ids: logprobs name their tokens token_id:<id>.
    return_tokens_as_token_ids: bool = False
    # vLLM's --chat-template: a template (a file's text) replacing the one the executor's handshake brings.
    chat_template: str = ""
    # vLLM's --default-chat-template-kwargs: the template variables every HTTP chat request starts from.
    default_chat_template_kwargs: dict[str, object] = field(default_factory=dict)
    # vLLM's --enable-force-include-usage: every streamed answer ends with its usage, as if asked.
    enable_force_include_usage: bool = False
    # vLLM's --trust-request-chat-template: a chat request's own chat_template is taken (refused otherwise).
    trust_request_chat_template: bool = False

    def cors(self) -> Cors:
        return Cors(self.allowed_origins, self.allowed_credentials, self.allowed_methods, self.allowed_headers)

    def chat_parsing(self) -> ChatParsing:
        """What reads chat answers: the HTTP routes', in this process or the API process (``Settings``)."""
        return ChatParsing(self.enable_auto_tool_choice, self.tool_call_parser, self.reasoning_parser,
                           self.responses_store, self.return_tokens_as_token_ids,
                           dict(self.default_chat_template_kwargs) or None, self.enable_force_include_usage,
                           self.trust_request_chat_template)

    def engine_options(self) -> dict[str, object]:
        """The ``Engine``'s own keyword arguments among these flags (its ``SchedulerConfig`` aside)."""
        return {"overlap": self.overlap, "step_timeout_s": self.step_timeout, "plans_ahead": self.plans_ahead}

    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler core's share of these flags (ValueError where they contradict each other)."""
        if self.max_num_batched_tokens < self.max_num_seqs:  # as vLLM refuses it
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): each running sequence's decode takes a token of a step's budget")
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.num_scheduler_steps,
                               self.scheduling_policy, self.max_loras, self.speculative, self.num_speculative_tokens,
                               self.ngram_min, self.ngram_max, self.speculative_disable_by_batch_size,
                               self.request_order)


def model_names(text: str) -> tuple[str, ...]:
    """One --served-model-name word, or the environment's whole value: names separated by whitespace."""
    names = tuple(text.split())
    if not names:
        raise argparse.ArgumentTypeError("is empty: give a name, or leave it unset for the executor's model id")
    return names


def served_names(given: Sequence[tuple[str, ...]] | tuple[str, ...] | None) -> tuple[str, ...]:
    """--served-model-name as one tuple, first given first, each once: the command line gives a tuple per word, the
    environment one tuple."""
    words = () if given is None else (given,) if given and isinstance(given[0], str) else given
    return tuple(dict.fromkeys(name for names in words for name in names))


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The parser; an environment variable sets a flag's default, so a flag on the command line wins."""
    defaults = ServiceConfig()
    parser = argparse.ArgumentParser(
        prog="nanoserve-scheduler",
        description="The nanoserve scheduler service: the public Generation API in front of one executor.",
        epilog=f"Every flag can also be set as {ENV_PREFIX}<FLAG>, e.g. {ENV_PREFIX}EXECUTOR; the flag wins.",
    )
    flags = EnvFlags(parser, env)

    def add(flag: str, type_, help_text: str, secret: bool = False, **kwargs) -> None:
        default = getattr(defaults, flag.lstrip("-").replace("-", "_"))
        flags.add(flag, type_, default, help_text, secret=secret, **kwargs)

    add("--executor", str, "executor service address HOST:PORT")
    flags.add("--served-model-name", model_names, None, "vLLM's flag: the names a request's 'model' may give the "
              "base model, the first reported everywhere (/v1/models, responses, the metrics' model_name, the gateway "
              "protocol's model info), e.g. '--served-model-name llama-3 llama'; the environment's value is the names "
              "separated by spaces (absent: the executor's model id)", nargs="+")
    add("--host", str, "address to serve the public API on")
    add("--port", port, "port to serve the public API on (0 picks a free one)")
    add("--max-num-seqs", positive_int, "most sequences in one step")
    add("--max-num-batched-tokens", positive_int, "most tokens computed in one step")
    add("--max-queued-requests", positive_int, "requests waiting to be scheduled before RESOURCE_EXHAUSTED")
    add("--log-level", str.upper, "logging level", choices=LOG_LEVELS)
    add("--max-queued-tokens", positive_int, "prompt tokens waiting to be scheduled before RESOURCE_EXHAUSTED")
    add("--max-message-bytes", grpc_message_bytes, "largest public-API message, each way (at most 2**31 - 1)")
    add("--step-timeout", positive_float, "seconds an executor call may take before the scheduler recovers")
    add("--shutdown-grace", non_negative_float, "seconds requests in flight get to finish on SIGTERM")
    add("--tls-cert", str, "PEM certificate chain of the public API (with --tls-key: serve TLS)")
    add("--tls-key", str, "PEM private key of --tls-cert")
    add("--tls-ca", str, "PEM CA: the public API then requires client certificates it signed")
    add("--executor-tls-ca", str, "PEM CA that signed the executor's certificate: TLS to the executor")
    add("--executor-tls-cert", str, "PEM client certificate for an executor that requires mutual TLS")
    add("--executor-tls-key", str, "PEM private key of --executor-tls-cert")
    # No default string for argparse to run through ``secret``: only a key given empty is refused.
    flags.add("--api-key", secret, None, "clients must send 'authorization: Bearer <key>'; prefer the environment",
              secret=True)
    add("--overlap", boolean, "schedule step N+1 while the executor runs step N ('--overlap off': one step at a time; "
        "default: on beside an accelerator, off with an executor on the CPU)")
    add("--plans-ahead", positive_int, "with overlap, plain steps sent ahead of the one the scheduler waits for, when "
        "their outputs cannot change the next plans (default: 2 beside an accelerator, which keeps it busy when a plan "
        "comes late; 1 with an executor on the CPU). Each one more delays an arrival's prefill and a cancel by a step")
    add("--num-scheduler-steps", positive_int, "the most decode steps per plan: the scheduling and the RPC are paid "
        "once per plan, and EOS and stop strings are seen only between plans. A plan computes no more steps than any "
        "of its requests' readers take tokens at a time (a stream's interval; whole completions: no limit), and a new "
        "request cuts one short after its current step")
    add("--scheduling-policy", str, "nano-vllm: prefill first, never in a step with decodes (the seed's policy); "
        "mixed: running decodes first, and prefill chunks fill the rest of --max-num-batched-tokens in the same step",
        choices=POLICY_NAMES)
    add("--request-order", str, "fcfs: requests are admitted in arrival order, and the latest preempted first; "
        "priority: by each request's priority (lower first, vLLM's --scheduling-policy priority), then arrival, and "
        "the lowest priority preempted first. Under fcfs a priority other than 0 is refused", choices=REQUEST_ORDERS)
    add("--max-loras", positive_int, "the most distinct LoRA adapters in one step (the base model not counted); a "
        "request for another waits, in arrival order, until an adapter's requests end")
    add("--stream-interval", positive_int, "tokens a stream gathers before they are sent (its first token and its "
        "end go at once): 1 sends each as it comes; more send fewer, larger messages, which costs this process "
        "less per token when it streams to many clients")
    add("--api-process", boolean, "serve the public gRPC API, and the HTTP API's completions, from a process of its "
        "own, which writes the streams: this process then spends its CPU on scheduling, not on a message per token "
        "(the metrics port stays here)")
    add("--api-process-cpu-share", share, "the most of a core the API process spends writing streams: past it, a "
        "step's outputs wait for the next ones and each message carries several tokens (hundreds of streams at a "
        "few milliseconds a step; a CPU's serving load stays far below it). 1: as fast as a core writes them "
        "(default: a tenth of the cores this process may use, at most 1: 0.2 on 2 cores)")
    add("--yield-cpu", boolean, "when the executor computes on the CPU, run this process's threads in SCHED_IDLE, so "
        "that they never preempt its forward pass on the cores they share: more offline throughput, a later first "
        "token (give the executor the same flag)")
    add("--http-port", port, "port of the OpenAI-compatible HTTP API on --host, with the same TLS and API key "
        "(0 turns it off)")
    add("--allowed-origins", json_strings, "JSON list of the origins whose browser pages may call the HTTP API "
        "(vLLM's flag; default any: '[\"*\"]')")
    add("--allowed-credentials", boolean, "let those pages send credentials (cookies, authorization headers)")
    add("--allowed-methods", json_strings, "JSON list of the HTTP methods they may use (default any)")
    add("--allowed-headers", json_strings, "JSON list of the request headers they may send (default any)")
    add("--metrics-port", port, "port of Prometheus /metrics alone on --host, with the same TLS certificate but "
        "without the API key or client certificates, for scrapers that send neither (0 turns it off)")
    add("--kv-events-config", kv_events_flag, "vLLM's KV-events JSON, e.g. '{\"endpoint\": \"tcp://*:5557\", "
        "\"topic\": \"kv\"}': publish the prefix cache's events over ZMQ in vLLM's format (empty: not over ZMQ; "
        "the gRPC SubscribeKvEvents serves them either way)")
    add("--record", str, "record the executor's handshake, every plan and every result into this directory, for "
        "`nanoserve replay` (docs/replay.md); the requests' text is left out unless --record-text")
    add("--record-at-start", boolean, "with --record, record from the start ('off': only once the StartRecording "
        "RPC or POST /admin/recording/start asks)")
    add("--record-text", boolean, "keep the tokenizer and chat template in the recording, so that its token ids "
        "read as text")
    add("--record-max-file-bytes", byte_size, "size of a recording file before the next one begins, e.g. 256M")
    add("--speculative", str, "speculative decoding: 'ngram' proposes the tokens that followed the last occurrence of "
        "a request's latest n tokens in its own context; 'draft' has the executor's draft model propose (the executor "
        "needs --speculative-model); outputs stay exactly those without it (absent: off)",
        choices=SPECULATIVE_METHODS)
    add("--num-speculative-tokens", positive_int, f"with --speculative, the most tokens proposed per request per step "
        f"(absent: {DEFAULT_NUM_SPECULATIVE_TOKENS})")
    add("--ngram-min", positive_int, f"with --speculative ngram, the shortest suffix matched (vLLM's "
        f"prompt_lookup_min; absent: --ngram-max, or {DEFAULT_NGRAM_SIZE})")
    add("--ngram-max", positive_int, f"with --speculative ngram, the longest suffix matched, tried first (vLLM's "
        f"prompt_lookup_max; absent: --ngram-min, or {DEFAULT_NGRAM_SIZE})")
    add("--speculative-disable-by-batch-size", positive_int, "with --speculative, propose nothing while more "
        "requests than this run (a large batch is bound by compute, where a proposed token costs what a decoded one "
        "does; absent: 4 on a CPU executor, never off on an accelerator)")
    add("--generation-config", str, "auto: a request that leaves temperature, top_p, top_k, min_p, "
        "repetition_penalty or max_tokens unset takes the model's generation_config.json value (max_new_tokens for "
        "max_tokens), as vLLM's default does; vllm: the scheduler's own defaults", choices=GENERATION_CONFIGS)
    add("--enable-auto-tool-choice", boolean, "vLLM's flag: take tool_choice 'auto' (the default of a chat request "
        "with tools), reading the answer for tool calls with --tool-call-parser; without it such a request is a 400. "
        "tool_choice 'required' and a named function need neither flag")
    add("--tool-call-parser", str, "vLLM's flag: the model's tool-call format, read out of 'auto' answers: hermes "
        "(Qwen2.5, Qwen3, Hermes: <tool_call>{...}</tool_call>), llama3_json (Llama 3.x JSON calls), pythonic "
        "(Llama 3.2, Llama 4, ToolACE: [f(a=1), g()]) or mistral (Mistral 7B Instruct v0.3, Nemo: [TOOL_CALLS])",
        choices=tuple(TOOL_PARSERS))
    add("--reasoning-parser", str, "vLLM's flag: take a chat answer's thinking (<think>...</think>) out of its content "
        "into the message's 'reasoning', whole and streamed: qwen3 (Qwen3, QwQ; 'enable_thinking': false in "
        "chat_template_kwargs turns it off) or deepseek_r1 (DeepSeek-R1 and its distillations); structured output "
        "then waits for the thinking's end, as vLLM's",
        choices=tuple(REASONING_PARSERS))
    add("--enable-server-load-tracking", boolean, "vLLM's flag: GET /load answers how many chat, completion, "
        "response, message and generate requests the HTTP API is answering (until each answer is sent; 0 without "
        "the flag)")
    add("--enable-request-id-headers", boolean, "vLLM's flag: every HTTP answer carries an X-Request-Id header, the "
        "request's own (which also names the request: chatcmpl-<id>, cmpl-<id>) or a new random one")
    add("--server-dev-mode", boolean, "vLLM's VLLM_SERVER_DEV_MODE as a flag: serve the dev routes "
        "/reset_prefix_cache, /pause, /resume and /is_paused (guarded by --api-key where one is set)")
    add("--return-tokens-as-token-ids", boolean, "vLLM's flag: the logprobs of chat, completion, response and "
        "generate answers name their tokens 'token_id:<id>' (a token that is no whole character stays exact), "
        "unless a request's return_tokens_as_token_ids says otherwise")
    add("--responses-store", non_negative_int, "how many /v1/responses answers asked with store (the Responses "
        "API's default) are kept in memory, the oldest dropped first, for previous_response_id, "
        "GET /v1/responses/{id} and background mode; 0 keeps none, as vLLM without "
        "VLLM_ENABLE_RESPONSES_API_STORE (which keeps all)")
    add("--chat-template", file_or_text, "vLLM's flag: a chat template (a file's path, or the template itself) that "
        "replaces the model's, for chat requests over HTTP and gRPC and the gateways' tokenizer bundle")
    add("--default-chat-template-kwargs", json_object, "vLLM's flag: a JSON object of chat template variables every "
        "HTTP chat request starts from, such as '{\"enable_thinking\": false}'; a request's chat_template_kwargs win")
    add("--enable-force-include-usage", boolean, "vLLM's flag: every chunk of a streamed chat or completion answer "
        "carries its usage, as if stream_options asked include_usage and continuous_usage_stats")
    add("--trust-request-chat-template", boolean, "vLLM's flag: a chat request's own chat_template renders its "
        "conversation (in a sandbox); without it such a request is a 400")
    return parser


def parse_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServiceConfig:
    parser = build_parser(os.environ if env is None else env)
    args = parser.parse_args(argv)
    config = ServiceConfig(**{**vars(args), "api_key": args.api_key or "",
                              "served_model_name": served_names(args.served_model_name)})
    try:
        config.scheduler_config()
    except ValueError as e:
        parser.error(str(e).replace("_", "-"))
    clash = port_clash(config)
    if clash:
        parser.error(clash)
    if config.enable_auto_tool_choice and not config.tool_call_parser:  # as vLLM refuses it
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    if taken := sorted(TEMPLATE_VARIABLES.intersection(config.default_chat_template_kwargs)):
        parser.error(f"--default-chat-template-kwargs: {', '.join(taken)} the server sets for each request")
    return config


# What each port serves, for an error that tells apart vLLM's one --port (HTTP) and these.
PORT_FLAGS = (("--port", "port", "the gRPC port"), ("--http-port", "http_port", "the OpenAI HTTP port"),
              ("--metrics-port", "metrics_port", "the Prometheus /metrics port"))


def port_clash(config: ServiceConfig) -> str:
    """Two of the scheduler's ports on one number, which would fail later with a misleading "address already in
    use" (a vLLM user's --port 8000 meets the default --http-port); "" when none. 0 is no clash: any free port for
    --port, off for the other two."""
    taken: dict[int, tuple[str, str]] = {}
    for flag, attribute, serves in PORT_FLAGS:
        number = getattr(config, attribute)
        if number and number in taken:
            other, other_serves = taken[number]
            return (f"{other} and {flag} are both {number}: {other} is {other_serves} and {flag} {serves}; "
                    f"give each its own port (a vLLM user's --port is --http-port here)")
        taken[number] = flag, serves
    return ""

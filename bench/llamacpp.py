"""The llama.cpp peer of W1: llama-cpp-python's low-level API, batching continuously as llama-server does.

Every request gets a slot, one KV sequence of its own (``kv_unified`` off, so a token attends only to its
sequence's cells). Each ``llama_decode`` carries one decode token per generating slot and then as many
pending prompt tokens as the logical batch still holds, chunked across steps; the logits of each slot's
last token are argmaxed (greedy), a slot ends after exactly its max_tokens (EOS ignored) and its KV
sequence is cleared for the next request. The weights are the embedded model's, dequantized to the
benchmark's dtype by ``bench.gguf_convert``; the KV cache keeps that dtype too, as nanoserve's does.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from bench.common import WARMUP_PROMPT, Workload, progress
from bench.gguf_convert import GGUF_DTYPES, converted_gguf
from executor_svc.runtime.registry import EMBEDDED_MODELS

INSTALL = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python "llama-cpp-python>=0.3.36" gguf'
# llama-server's defaults: the logical batch one llama_decode takes, and the physical batch it computes at once.
N_BATCH = 2048
N_UBATCH = 512
SLOTS = 64
# Per-slot context is rounded up to this, as llama.cpp pads its context.
CONTEXT_PAD = 256
WARMUP_TOKENS = 4


def unavailable(args: argparse.Namespace) -> str | None:
    """Why this peer cannot run ``args`` (None when it can): it runs W1's embedded model on the CPU."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; build it from source with {INSTALL}"
    if args.workload != "w1" or args.device != "cpu" or args.model not in EMBEDDED_MODELS:
        return f"it runs W1 on the CPU with an embedded model ({', '.join(EMBEDDED_MODELS)})"
    return None


def admit(args: argparse.Namespace, peers: list[str]) -> list[str]:
    """``peers``, checked before any runs: llamacpp where it cannot run stops the run when ``--peers`` asked for
    it, and is left out with a note why when it came with the default (every peer)."""
    if "llamacpp" not in peers or not (reason := unavailable(args)):
        return peers
    if args.peers:
        raise SystemExit(f"the llamacpp peer cannot run: {reason}")
    print(f"leaving out the llamacpp peer: {reason}", file=sys.stderr)
    return [name for name in peers if name != "llamacpp"]


def import_llama_cpp() -> ModuleType:
    """llama_cpp, quiet below errors; SystemExit naming the install recipe when it is missing."""
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit(f"the llamacpp peer needs llama-cpp-python built from source: {INSTALL}") from e
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


@dataclass
class Slot:
    """Request ``request`` in a slot: its prompt is decoded up to ``fed``, ``out`` holds what it generated."""

    request: int
    prompt: list[int]
    max_tokens: int
    fed: int = 0
    out: list[int] = field(default_factory=list)


class ContinuousBatcher:
    """One llama.cpp context of ``slots`` KV sequences of ``slot_len`` tokens each."""

    def __init__(self, path: Path, dtype: str, threads: int, slots: int, slot_len: int) -> None:
        self.lib = lib = import_llama_cpp()
        lib.llama_backend_init()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = lib.llama_context_default_params()
        params.n_ctx = slots * -(-slot_len // CONTEXT_PAD) * CONTEXT_PAD
        params.n_batch, params.n_ubatch, params.n_seq_max = N_BATCH, N_UBATCH, slots
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        params.type_k = params.type_v = int(GGUF_DTYPES[dtype][0])
        self.ctx = lib.llama_init_from_model(self.model, params)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise RuntimeError("llama.cpp could not create its context")
        self.slots = slots
        self.memory = lib.llama_get_memory(self.ctx)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        # Views of the batch's arrays, so a step fills them without a ctypes call per field.
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(N_BATCH,))
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(N_BATCH,))
        self.wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(N_BATCH,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(N_BATCH,))[:] = 1
        self.seq_ids = [self.batch.seq_id[i] for i in range(N_BATCH)]

    def generate(self, prompts: list[list[int]], max_tokens: list[int],
                 on_step: Callable[[int], object] | None = None) -> list[list[int]]:
        """Greedy completions of exactly ``max_tokens[i]`` tokens; ``on_step`` gets each step's token count."""
        waiting = deque(zip(range(len(prompts)), prompts, max_tokens, strict=True))
        free = deque(range(self.slots))
        running: dict[int, Slot] = {}
        outputs: list[list[int]] = [[] for _ in prompts]
        while waiting or running:
            while waiting and free:
                running[free.popleft()] = Slot(*waiting.popleft())
            sampled = self._step(running)
            for seq, token in sampled:
                slot = running[seq]
                slot.out.append(token)
                if len(slot.out) == slot.max_tokens:
                    outputs[slot.request] = slot.out
                    self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del running[seq]
                    free.append(seq)
            if on_step is not None:
                on_step(len(sampled))
        return outputs

    def _step(self, running: dict[int, Slot]) -> list[tuple[int, int]]:
        """One llama_decode: decodes first, then prompt chunks; (seq, greedy token) of every logits row."""
        n, rows = 0, []

        def add(seq: int, tokens: list[int], start: int, last_has_logits: bool) -> None:
            nonlocal n
            end = n + len(tokens)
            self.tokens[n:end] = tokens
            self.positions[n:end] = np.arange(start, start + len(tokens))
            self.wants_logits[n:end] = 0
            self.wants_logits[end - 1] = last_has_logits
            for i in range(n, end):
                self.seq_ids[i][0] = seq
            n = end
            if last_has_logits:
                rows.append(seq)

        for seq, slot in running.items():
            if slot.out:
                add(seq, slot.out[-1:], len(slot.prompt) + len(slot.out) - 1, True)
        for seq, slot in running.items():
            if slot.fed < len(slot.prompt) and n < N_BATCH:
                chunk = slot.prompt[slot.fed : slot.fed + N_BATCH - n]
                add(seq, chunk, slot.fed, slot.fed + len(chunk) == len(slot.prompt))
                slot.fed += len(chunk)
        self.batch.n_tokens = n
        if (code := self.lib.llama_decode(self.ctx, self.batch)) != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        if not rows:  # a step of prompt chunks only, none of them a prompt's end
            return []
        logits = np.ctypeslib.as_array(self.lib.llama_get_logits(self.ctx), shape=(len(rows), self.n_vocab))
        return list(zip(rows, logits.argmax(axis=1).tolist(), strict=True))

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def __enter__(self) -> ContinuousBatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def slot_len(workload: Workload) -> int:
    """Room for the longest request (and the warm-up): its prompt and what it generates."""
    longest = max(len(p) + m for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
    return max(longest, len(WARMUP_PROMPT) + WARMUP_TOKENS)


def run_llamacpp(args: argparse.Namespace, workload: Workload) -> float:
    """llama.cpp with 64 slots batching continuously, greedy; seconds of generation."""
    if reason := unavailable(args):
        raise SystemExit(f"the llamacpp peer cannot run: {reason}")
    path = converted_gguf(args.model, args.dtype)
    with ContinuousBatcher(path, args.dtype, args.threads, SLOTS, slot_len(workload)) as batcher:
        batcher.generate([WARMUP_PROMPT], [WARMUP_TOKENS])
        start = time.perf_counter()
        with progress(total=sum(workload.max_tokens), desc="llama.cpp", unit="tok") as bar:
            outputs = batcher.generate(workload.prompts, workload.max_tokens, bar.update)
        seconds = time.perf_counter() - start
    assert [len(o) for o in outputs] == workload.max_tokens, "a llama.cpp request ended early"
    return seconds


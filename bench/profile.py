"""Where W1's in-process time goes: wall seconds per component of the model step, prefill and decode apart.

Runs W1 (BENCHMARKS.md; ``--workload w2``: W2's requests, whose prompts of up to 1,024 tokens show long prompts'
prefill) through the scheduler Engine and the ModelExecutor in this process, as
``bench.throughput``'s ``inprocess`` peer does, with a timer around each component's Python entry point:
the linear layers (``LinearBase.matmul``, LM head included), attention's store and compute, RMSNorm, the
rotary embedding, SiLU-and-mul, the embedding and the sampler; a decode step the C decoder stack ran
(``executor_svc/cpu/decode_stack.py``) counts as one ``stack (C layers)``, its projections included
where they run in torch, which ``--cpu-decode-stack off`` splits into its families. ``other`` is the rest of
the forward pass (Python between the ops); ``scheduling, batch`` is what ``Engine.step`` spends outside the
forward pass and the sampler (scheduling, the plan, packing the batch, postprocessing). The stack's own time
is split as well (``stack_*_s``): its projections in torch, its C attention (rotary, KV store, attention), its C
RMSNorms and SiLU-and-mul, the one C call of a step whose projections run C too, and the Python between them.
The timers cost ~1 us a call, a few tenths of a second over a run.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from executor_svc.cpu.malloc import keep_heap_memory
from executor_svc.cpu.openmp import set_wait_policy

set_wait_policy()
keep_heap_memory()

from bench.common import WORKLOADS, print_table, progress, write_json  # noqa: E402
from executor_svc.__main__ import cpu_kernels_flag  # noqa: E402
from executor_svc.attention.cpu_backend import CpuAttention  # noqa: E402
from executor_svc.attention.torch_backend import TorchAttention  # noqa: E402
from executor_svc.cpu.decode_stack import CpuDecodeStack  # noqa: E402
from executor_svc.layers.activation import SiluAndMul  # noqa: E402
from executor_svc.layers.embedding import VocabParallelEmbedding  # noqa: E402
from executor_svc.layers.linear import LinearBase  # noqa: E402
from executor_svc.layers.norm import RMSNorm  # noqa: E402
from executor_svc.layers.rotary import RotaryEmbedding  # noqa: E402
from executor_svc.runtime import model_runner  # noqa: E402
from executor_svc.runtime.config import ExecutorOptions  # noqa: E402
from executor_svc.runtime.model_executor import ModelExecutor  # noqa: E402
from executor_svc.runtime.model_input import ModelInput  # noqa: E402
from executor_svc.sample.sampler import Sampler  # noqa: E402
from scheduler_svc.core.sampling import SamplingParams  # noqa: E402
from scheduler_svc.engine.engine import Engine  # noqa: E402

# (component, class, method). A call inside a call of the same component (CpuAttention falling back to
# TorchAttention's decode) is counted once.
COMPONENTS = [
    ("linear", LinearBase, "matmul"),
    ("attention", TorchAttention, "prefill"),
    ("attention", TorchAttention, "decode"),
    ("attention", CpuAttention, "decode"),
    ("attention", CpuAttention, "prefill"),
    ("kv store", TorchAttention, "store_kv"),
    ("kv store", CpuAttention, "store_kv"),
    ("rms_norm", RMSNorm, "forward"),
    ("rotary", RotaryEmbedding, "forward"),
    ("silu_and_mul", SiluAndMul, "forward"),
    ("embedding", VocabParallelEmbedding, "forward"),
    ("sampler", Sampler, "__call__"),
    ("stack (C layers)", CpuDecodeStack, "run"),
]


# The parts of the C decoder stack's time (decode steps only): table row, JSON key (``stack_<key>_s``).
STACK_PARTS = {"projections (torch)": "projections", "attention (C)": "attention", "norms, SiLU (C)": "norms_silu",
               "whole-C call": "whole_c"}


class Timers:
    """Seconds per (phase, component); the phase is that of the forward pass last started."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.phase = "prefill"
        self.steps: dict[str, int] = defaultdict(int)
        self.running: set[str] = set()

    def watch_phase(self, stack: ExitStack) -> None:
        execute = model_runner.ModelRunner.execute
        stack.callback(setattr, model_runner.ModelRunner, "execute", execute)

        def execute_in_phase(runner: model_runner.ModelRunner, model_input: ModelInput, *behind: object):
            self.phase = "prefill" if model_input.meta.is_prefill else "decode"
            self.steps[self.phase] += 1
            return execute(runner, model_input, *behind)

        model_runner.ModelRunner.execute = execute_in_phase

    def wrap(self, stack: ExitStack, name: str, cls: type, method: str) -> None:
        """Time ``cls.method`` as ``name``; a class that inherits the method is timed through its parent's."""
        if method not in vars(cls):
            return
        original = vars(cls)[method]
        stack.callback(setattr, cls, method, original)
        setattr(cls, method, self._timed(name, original))

    def wrap_stack_parts(self, stack: ExitStack, decoder_stack: CpuDecodeStack) -> None:
        """Time the decoder stack's calls from Python: its kernels and the torch projections it holds."""
        for attribute, name in (("_attention", "attention (C)"), ("_rms_norm", "norms, SiLU (C)"),
                                ("_silu_and_mul", "norms, SiLU (C)"), ("_run", "whole-C call")):
            original = getattr(decoder_stack, attribute)
            stack.callback(setattr, decoder_stack, attribute, original)
            setattr(decoder_stack, attribute, self._timed(name, original))
        layers = decoder_stack.torch_layers
        stack.callback(setattr, decoder_stack, "torch_layers", layers)
        projection = "projections (torch)"
        decoder_stack.torch_layers = [
            (spec, input_norm, post_norm, self._timed(projection, qkv), qkv_bias, self._timed(projection, o),
             self._timed(projection, gate_up), gate_up_bias, self._timed(projection, down))
            for spec, input_norm, post_norm, qkv, qkv_bias, o, gate_up, gate_up_bias, down in layers
        ]

    def _timed(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if name in self.running:
                return fn(*args, **kwargs)
            self.running.add(name)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.phase, name] += time.perf_counter() - start
                self.running.discard(name)

        return timed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (W1: 2)")
    parser.add_argument("--model", default=ExecutorOptions.model,
                        help="embedded model name or local HF folder (python -m bench.random_model FOLDER --arch "
                             "smollm2-135m where the embedded one is missing)")
    parser.add_argument("--workload", choices=["w1", "w2"], default="w1",
                        help="w1, or W2's requests (prompts of 100-1024 tokens, temperature 0.6) on this machine")
    parser.add_argument("--num-requests", type=int, help="run only the first N requests")
    parser.add_argument("--cpu-decode-stack", choices=["on", "off"], default="on",
                        help="off: decode steps layer by layer, so that each family's share shows")
    parser.add_argument("--cpu-kernels", type=cpu_kernels_flag, default="auto",
                        help="the executor's --cpu-kernels (e.g. another machine's choice: linear:33+=torch)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]().head(args.num_requests)
    options = ExecutorOptions(model=args.model, dtype=args.dtype, kv_cache_memory=2 << 30, threads=args.threads,
                              max_model_len=workload.max_model_len, cpu_decode_stack=args.cpu_decode_stack == "on",
                              cpu_kernels=args.cpu_kernels)
    engine = Engine(ModelExecutor(options))
    engine.generate([list(range(100, 132))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    timers = Timers()
    with ExitStack() as stack:
        for name, cls, method in COMPONENTS:
            timers.wrap(stack, name, cls, method)
        timers.wrap(stack, "forward", model_runner.ModelRunner, "execute")
        timers.watch_phase(stack)
        timers.wrap(stack, "step", Engine, "step")
        decoder_stack = getattr(engine.executor.runner.model.model, "cpu_stack", None)
        if decoder_stack is not None:
            timers.wrap_stack_parts(stack, decoder_stack)
        for prompt, limit in zip(workload.prompts, workload.max_tokens, strict=True):
            engine.add_request(prompt, SamplingParams(temperature=workload.temperature, max_tokens=limit,
                                                      ignore_eos=True))
        start = time.perf_counter()
        with progress(total=sum(workload.max_tokens), desc=args.workload.upper(), unit="tok") as bar:
            while engine.has_unfinished():
                bar.update(sum(len(o.token_ids) for o in engine.step()))
        total = time.perf_counter() - start
    steps = timers.steps
    seconds = timers.seconds
    rows, figures = [], {"total_s": total, "tok_s": sum(workload.max_tokens) / total}
    components = list(dict.fromkeys(name for name, _, _ in COMPONENTS))
    for phase in ("prefill", "decode"):
        inside = sum(seconds[phase, name] for name in components if name != "sampler")  # it runs after the forward
        parts = {name: seconds[phase, name] for name in components}
        parts["other (forward)"] = seconds[phase, "forward"] - inside
        parts["scheduling, batch"] = seconds[phase, "step"] - seconds[phase, "forward"] - seconds[phase, "sampler"]
        for name, value in parts.items():
            rows.append([phase, name, value, 100 * value / total])
            figures[f"{phase}_{name.split(' ')[0].rstrip(',')}_s"] = value
        figures[f"{phase}_steps"] = steps[phase]
    stack_s = seconds["decode", "stack (C layers)"]
    if stack_s > 0:
        parts = {name: seconds["decode", name] for name in STACK_PARTS}
        parts["python between"] = stack_s - sum(parts.values())
        for name, value in parts.items():
            rows.append(["decode", f"stack: {name}", value, 100 * value / total])
            figures[f"stack_{STACK_PARTS.get(name, 'python')}_s"] = value
    print(f"{args.workload.upper()}, {args.dtype}, {args.threads} threads: {total:.2f} s, "
          f"{figures['tok_s']:.1f} tok/s, {steps['prefill']} prefill and {steps['decode']} decode steps")
    print_table(["phase", "component", "seconds", "% of run"], rows)
    write_json(args.json, figures)


if __name__ == "__main__":
    main()

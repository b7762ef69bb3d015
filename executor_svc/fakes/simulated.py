"""A simulated accelerator: the real executor's CPU side of every step, with the GPU's part as a fixed wait.

W5 (``bench.overlap``) measures what the split costs a GPU, without a GPU. Each step does what
``ModelExecutor`` does on its CPU: validate and apply the plan (``RequestTable``), pack the step's input
tensors and attention metadata (``model_input.prepare_input``, as the runner does before copying them to the
device), put in the tokens the step before sampled, record the sampled tokens and build the ``StepResult``.
The forward pass and the sampling run on a simulated device: ``launch`` returns at once with the device busy
for ``step_ms`` from then, ``finish`` waits for it (``accelerator_wait``), releasing the GIL as a CUDA
synchronize does, and every sampled token is one fixed id that is not an EOS id (so nothing ends before its
``max_tokens``; CPU work that would compute a token here would be work the GPU does). Its small tensor ops run
on one torch thread (``--threads``), as a GPU host with cores to spare would run them without waiting for an
OpenMP team.

``python -m executor_svc.fakes.simulated --step-ms 5 [--port 50052 ...]`` serves it like the model-free
executors of ``shadow_server``.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.security import TLSConfig
from common.step import ExecutorInfo, StepResult
from executor_svc.core.request_table import RequestTable, ScheduledChunk
from executor_svc.core.step_pipeline import TableExecutor
from executor_svc.cpu.kernels import kernel_library
from executor_svc.fakes.shadow_server import model_free_info
from executor_svc.runtime.model_input import DecodeTables, ModelInput, prepare_input
from executor_svc.service import serve

PR_SET_TIMERSLACK = 29
LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None
# The last stretch of a wait is spun (``spin_until``, without the GIL), not slept, as a CUDA synchronize spins: on
# the development VMs a sleep of a few ms woke late even at 1 ns timer slack, and a spin half this long left W5's
# efficiency lower than this one. Sleeps ending later than this still wake late.
SPIN_S = 300e-6


_slack = threading.local()


def accelerator_wait(deadline: float) -> None:
    """Wait until ``deadline`` (``time.perf_counter``) without the GIL, as a CUDA synchronize does: ``time.sleep``
    until ``SPIN_S`` before it, then a spin in C (``csrc/spin_wait.c``; a plain sleep where the kernels cannot be
    built). This thread's timer slack is set to 1 ns where Linux allows (its default of 50 us made sleeps measurably
    longer), once per thread: each foreign call releases the GIL, and another thread then held it at the wait's
    end."""
    if LIBC is not None and not getattr(_slack, "set", False):
        LIBC.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
        _slack.set = True
    library = kernel_library()
    if (left := deadline - time.perf_counter()) > SPIN_S:
        time.sleep(left - (SPIN_S if library is not None else 0.0))
    if library is not None:
        library.spin_until(deadline)
    elif (left := deadline - time.perf_counter()) > 0:
        time.sleep(left)


@dataclass(slots=True)
class Launched:
    """A step on the simulated device: when it started and when the device is done with it."""

    chunks: list[ScheduledChunk]
    started: float
    done_at: float
    # Every chunk samples (a decode step), as ``ModelExecutor.finish`` looks: no walk over the chunks for the tokens.
    every_chunk_samples: bool
    # Its tokens taken on the device at launch, as ``ModelRunner`` takes a decode step's whose sampling needs nothing
    # of the host (``ModelInput.samples_on_device``): the step after it is launched behind it.
    sampled_ahead: bool = False


class SimulatedExecutor(TableExecutor):
    """The executor contract with every per-step CPU cost of ``ModelExecutor`` and a wait for the rest."""

    def __init__(self, info: ExecutorInfo, step_ms: float) -> None:
        super().__init__()
        self.info = info
        self.step_s = step_ms / 1e3
        self.table = RequestTable(info.num_blocks, info.block_size, info.vocab_size, info.max_model_len)
        self.token_id = next(t for t in range(1, info.vocab_size) if t not in info.eos_token_ids)
        self.tables = DecodeTables()
        self._waited_at = 0.0  # time.perf_counter when ``finish`` last waited for the device, as ``ModelRunner``'s
        kernel_library()  # built now (once per machine), not in the first step's wait

    def pack(self, chunks: list[ScheduledChunk], before: list[ScheduledChunk] | None = None) -> ModelInput:
        inputs = prepare_input(chunks, self.info.block_size, tables=self.tables)
        inputs.link(before)
        return inputs

    def launches_ahead(self, inputs: ModelInput | None) -> bool:
        return True

    def fills_ahead(self, inputs: ModelInput | None) -> bool:
        return inputs is not None and inputs.linked is not None

    def samples_ahead(self, launched: Launched) -> bool:
        return launched.sampled_ahead

    def launch(self, chunks: list[ScheduledChunk], inputs: ModelInput | None = None,
               sampled_before: list[int] | None = None, behind: Launched | None = None) -> Launched:
        """``ModelRunner.launch``: the input completed, then the device busy for ``step_ms`` from now, or from when
        it has computed ``behind``, the step before, whose tokens the input takes there."""
        started = time.perf_counter()
        inputs = inputs or self.pack(chunks)
        inputs.fill_pending(sampled_before if behind is None else [self.token_id] * len(behind.chunks))
        every = inputs.num_sampled == len(chunks)
        begins = time.perf_counter() if behind is None else max(time.perf_counter(), behind.done_at)
        return Launched(chunks, started, begins + self.step_s, every, inputs.samples_on_device)

    def finish(self, launched: Launched) -> StepResult:
        """``ModelRunner.finish`` and ``ModelExecutor.finish``: the wait for the device, then its tokens."""
        began = max(launched.started, self._waited_at)
        accelerator_wait(launched.done_at)
        self._waited_at = time.perf_counter()
        forward_ms = (self._waited_at - began) * 1e3
        if launched.every_chunk_samples:
            return StepResult([self.token_id] * len(launched.chunks), [], forward_ms, 0.0)
        return StepResult([self.token_id if chunk.samples else 0 for chunk in launched.chunks], [], forward_ms, 0.0)

    def forward(self, chunks: list[ScheduledChunk], inputs: ModelInput | None = None) -> StepResult:
        """One pass of a multi-step plan: launched and waited for at once."""
        return self.finish(self.launch(chunks, inputs))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m executor_svc.fakes.simulated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=5.0,
                        help="milliseconds each forward pass + sampling waits (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the step's small tensor ops (default: %(default)s: a GPU host has "
                             "cores to spare, and on a shared CPU a team of OpenMP threads only waits for them)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=50052, help="port to bind (default: %(default)s)")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks to report (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=32000,
                        help="token ids are below it (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="longest prompt + completion in tokens (default: %(default)s)")
    parser.add_argument("--eos-token-ids", type=lambda s: [int(t) for t in s.split(",") if t], default=[0],
                        help="comma-separated EOS token ids, never sampled (default: 0)")
    parser.add_argument("--tls-cert", help="PEM certificate chain; with --tls-key, serve TLS (default: plaintext)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA; clients must then present a certificate it signed (mutual TLS)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser.parse_args(argv)


def simulated_executor(args: argparse.Namespace,
                       kind: type[SimulatedExecutor] = SimulatedExecutor) -> SimulatedExecutor:
    """The executor the flags describe, and this process's torch threads set to ``--threads``
    (``bench.overlap`` builds its in-process peer with the same flags)."""
    if args.step_ms < 0 or args.threads < 1:
        raise SystemExit(f"--step-ms must be >= 0 and --threads >= 1, got {args.step_ms} and {args.threads}")
    torch.set_num_threads(args.threads)
    # Its device is an accelerator's stand-in: the scheduler treats it as one (``set_gil_switch_interval``).
    return kind(model_free_info(args, "simulated", "", "", device="simulated"), args.step_ms)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    executor = simulated_executor(args)
    serve(executor, args.host, args.port, tls=TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca))


if __name__ == "__main__":
    main()

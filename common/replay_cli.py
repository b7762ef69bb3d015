"""The command line of ``nanoserve replay`` (docs/replay.md), shared by its two halves: ``client.replay`` drives an
executor service over gRPC, and hands ``--shadow`` and ``--model`` to ``python -m executor_svc.runtime.replay``,
which builds that executor in its own process. Both parse the same arguments and print the same report.

Exit codes: 0 every result as recorded; 1 a difference (a token, or a plan refused or failed that the recorded
executor ran); 2 a bad command line, or a recording that cannot be read; 3 the executor is unreachable.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from common.executor import Executor
from common.flags import byte_size
from common.recording import Recording, RecordingError
from common.replay import Replayer
from common.replay_report import render, to_json
from common.step import ExecutorInfo
from common.step_codec import info_from_proto

EXIT_DIFFERENT = 1
EXIT_UNREADABLE = 2
EXIT_UNAVAILABLE = 3
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, metavar="DIR", help="the scheduler's --record directory")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--executor", metavar="HOST:PORT", help="an executor service (nanoserve-executor, or any "
                        "other speaking executor.proto); it is reset first, so give it to no scheduler meanwhile")
    target.add_argument("--shadow", action="store_true", help="the model-free shadow-KV executor in process, sized "
                        "as the recorded one (identical only for a recording made on it)")
    target.add_argument("--model", metavar="FOLDER", help="a model in process: a Hugging Face folder or an "
                        "embedded model's name")
    parser.add_argument("--pace", choices=("fast", "recorded"), default="fast",
                        help="send each plan as soon as the last is answered, or at its recorded time "
                        "(default: %(default)s)")
    parser.add_argument("--session", help="replay only this session (a file name's part before its index)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    model = parser.add_argument_group("--model options (default: as recorded where it says, else the executor's)")
    model.add_argument("--dtype", choices=DTYPES, help="compute dtype (default: the recorded one)")
    model.add_argument("--device", help="torch device, e.g. cpu or cuda (default: cuda when available)")
    model.add_argument("--kv-cache-memory", type=byte_size, metavar="BYTES",
                       help="KV-cache bytes, e.g. 4GiB: enough for the recorded number of blocks")
    model.add_argument("--attention-backend", help="cpu, torch, triton or flash_attn")
    model.add_argument("--threads", type=int, help="torch threads on the CPU")
    remote = parser.add_argument_group("--executor options")
    remote.add_argument("--timeout", type=float, default=600.0, help="seconds a step may take (default: %(default)s)")
    remote.add_argument("--tls-ca", help="PEM CA that signed the executor's certificate: connect with TLS")
    remote.add_argument("--tls-cert", help="PEM client certificate, for an executor that requires mutual TLS")
    remote.add_argument("--tls-key", help="PEM private key of --tls-cert")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(parser)
    return parser


def open_recording(args: argparse.Namespace) -> Recording:
    """Every file checked first: a torn or damaged recording is refused before anything is sent."""
    return Recording(args.directory, args.session)


def recorded_executor(recording: Recording) -> ExecutorInfo:
    """The executor the recording was made on (its first handshake), with the largest KV cache of any session: what
    an executor built for the replay must hold."""
    infos = []
    for session in recording.sessions:
        record = next(recording.records(session), None)
        if record is None or record.WhichOneof("entry") != "handshake":
            raise RecordingError(f"session {session.name} does not begin with the executor's handshake")
        infos.append(info_from_proto(record.handshake))
    return replace(infos[0], num_blocks=max(info.num_blocks for info in infos))


def replay(executor: Executor, recording: Recording, args: argparse.Namespace) -> int:
    """Run the replay and print its report; the exit code."""
    replayer = Replayer(executor, pace=args.pace == "recorded")
    try:
        with tqdm(total=recording.num_records, desc="replay", unit="rec", disable=not sys.stderr.isatty()) as bar:
            report = replayer.run(recording, bar.update)
    except RecordingError as e:  # damaged past the checksums, or plans the executor cannot take (ReplayError)
        return refuse(e)
    print(json.dumps(to_json(report), indent=2) if args.json else render(report))
    return 0 if report.identical else EXIT_DIFFERENT


def refuse(error: Exception) -> int:
    print(f"error: {error}", file=sys.stderr)
    return EXIT_UNREADABLE

"""The recording as an operator runs it (docs/replay.md): rotated files that read back in order, a damaged
recording refused by file and byte, the admin switch over gRPC and HTTP (a start mid-stream loses no token),
a full disk that stops the recording and not the service, and the split stack recorded and replayed from the
command line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from client.cli import main as cli
from common.recording import MAGIC, SUFFIX, Recording, RecordingError, RecordingWriter, frame, record_bytes
from common.replay import Replayer
from common.replay_cli import recorded_executor
from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from executor_svc.runtime.replay import shadow_executor
from nanoserve.v1 import recording_pb2 as rpb
from nanoserve.v1 import recording_pb2_grpc as rpb_grpc
from tests.http_fixtures import hosted
from tests.replay_helpers import recorded
from tests.service_fixtures import (
    HOST,
    ROOT,
    TOKENIZER_VOCAB_SIZE,
    GatedExecutor,
    assert_idle,
    assert_idle_async,
    byte_level_tokenizer,
    executor_argv,
    free_port,
    in_process_scheduler,
    running_stack,
    spawn,
    stop_process,
    token_request,
    wait_serving,
)
from tests.test_metrics import scrape, value

VOCAB = 50
KEY = "admin-key"


def shadow() -> ShadowExecutor:
    return ShadowExecutor(64, 4, VOCAB, (0,))


def reset_payload(n: int) -> bytes:
    return rpb.ExecutorReset(num_dropped_requests=n).SerializeToString()


def write_session(directory: Path, num_records: int, max_file_bytes: int) -> list[int]:
    writer = RecordingWriter(directory, "s", 0.0, False, max_file_bytes)
    for n in range(num_records):
        writer.write([record_bytes("reset", float(n), reset_payload(n))])
    writer.close()
    return list(range(num_records))


def test_a_session_rotates_into_files_that_read_back_in_order(tmp_path: Path):
    written = write_session(tmp_path, 40, max_file_bytes=100)
    files = sorted(tmp_path.glob(f"*{SUFFIX}"))
    assert len(files) > 3 and all(f.stat().st_size <= 100 for f in files)
    recording = Recording(tmp_path)
    (session,) = recording.sessions
    assert session.files == files and recording.num_records == 40
    assert [r.reset.num_dropped_requests for r in recording.records(session)] == written
    assert [r.time_s for r in recording.records(session)] == [float(n) for n in written]


def damaged(tmp_path: Path, how: str) -> Path:
    write_session(tmp_path, 40, max_file_bytes=200)
    files = sorted(tmp_path.glob(f"*{SUFFIX}"))
    data = files[1].read_bytes()
    if how == "truncated":
        files[1].write_bytes(data[:-3])
    elif how == "corrupt":  # a bit flipped in the last record's payload
        files[1].write_bytes(data[:-1] + bytes([data[-1] ^ 0x10]))
    elif how == "foreign":
        files[1].write_bytes(b"PK\x03\x04" + data[4:])
    else:
        files[1].unlink()
    return files[1]


@pytest.mark.parametrize(("how", "message"), [
    ("truncated", "is truncated at byte"),
    ("corrupt", "checksum does not match"),
    ("foreign", "is not a nanoserve recording"),
    ("missing", "file 1 is missing"),
])
def test_a_damaged_recording_is_refused_naming_the_file(tmp_path: Path, how: str, message: str,
                                                        capsys: pytest.CaptureFixture):
    path = damaged(tmp_path, how)
    with pytest.raises(RecordingError, match=message) as refused:
        Recording(tmp_path)
    assert path.name in str(refused.value) or how == "missing"
    assert cli(["replay", str(tmp_path), "--executor", f"{HOST}:1"]) == 2, "refused before any executor is asked"
    assert message in capsys.readouterr().err


def test_another_sessions_damaged_file_does_not_stand_in_the_way_of_this_one(tmp_path: Path):
    damaged(tmp_path, "truncated")  # session "s"
    write_good = RecordingWriter(tmp_path, "g", 1.0, False, 1 << 20)
    write_good.write([record_bytes("reset", 1.0, reset_payload(1))])
    write_good.close()
    assert Recording(tmp_path, "g").sessions[0].num_records == 1
    with pytest.raises(RecordingError, match="is truncated at byte"):
        Recording(tmp_path)


def test_a_full_disk_at_a_new_file_leaves_no_file_without_its_header(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    def disk_full(self: RecordingWriter, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RecordingWriter, "_append", disk_full)
    with pytest.raises(OSError, match="No space"):
        RecordingWriter(tmp_path, "s", 0.0, False, 1 << 20)
    assert list(tmp_path.glob(f"*{SUFFIX}")) == [], "a reader could open no recording in this directory"


def test_a_session_without_a_record_is_refused_for_replay(tmp_path: Path):
    RecordingWriter(tmp_path, "e", 0.0, False, 1 << 20).close()  # killed before its first batch was written
    with pytest.raises(RecordingError, match="does not begin with the executor's handshake"):
        recorded_executor(Recording(tmp_path))


def test_a_recording_of_a_newer_format_is_refused(tmp_path: Path):
    header = rpb.RecordingHeader(version=2, session="t").SerializeToString()
    (tmp_path / f"t-00000{SUFFIX}").write_bytes(MAGIC + frame(header))
    with pytest.raises(RecordingError, match="format version 2; this nanoserve reads version 1"):
        Recording(tmp_path)


async def generate(stub, prompt: list[int], max_tokens: int) -> list[int]:
    return [t async for r in stub.Generate(token_request(prompt, max_tokens, ignore_eos=True)) for t in r.token_ids]


def test_the_admin_switch_starts_mid_stream_without_losing_a_token_and_stops(tmp_path: Path):
    prompt = [3, 4, 5, 6, 7]
    expected = reference_generate(prompt, 60, VOCAB, {0}, True)

    gate = GatedExecutor(shadow(), steps_before_closing=3)  # the stream is held mid-way until the start is asked

    async def main():
        async with in_process_scheduler(gate, record=str(tmp_path), record_at_start=False) as s:
            admin = rpb_grpc.RecordingStub(grpc.aio.insecure_channel(f"{HOST}:{s.server.port}"))
            before = await admin.GetRecording(rpb.GetRecordingRequest())
            call = s.stub.Generate(token_request(prompt, 60, ignore_eos=True))
            tokens = list((await call.read()).token_ids)
            starting = asyncio.ensure_future(admin.StartRecording(rpb.StartRecordingRequest()))
            await asyncio.sleep(0.05)
            gate.open.set()
            started = await starting
            again = await admin.StartRecording(rpb.StartRecordingRequest())
            while (response := await call.read()) is not grpc.aio.EOF:
                tokens += response.token_ids
            stopped = await admin.StopRecording(rpb.StopRecordingRequest())
            await admin.StartRecording(rpb.StartRecordingRequest())
            second = await generate(s.stub, [9, 8, 7], 12)
            await assert_idle_async(s.stub)
            return before, started, again, tokens, stopped, second

    before, started, again, tokens, stopped, second = asyncio.run(main())
    assert not before.active and not before.session and before.directory == str(tmp_path)
    assert started.active and not started.starting and started.session and again.session == started.session
    assert tokens == expected, "the executor's reset at the start lost or changed tokens"
    first = Recording(tmp_path)
    resent = [list(n.token_ids) for r in first.records(first.sessions[0]) if r.HasField("plan")
              for n in r.plan.new_requests]
    # The executor's reset at the start sends the stream's request again with the tokens it had streamed so far.
    assert any(t[:len(prompt)] == prompt and 0 < len(t) - len(prompt) < len(expected)
               and t[len(prompt):] == expected[:len(t) - len(prompt)] for t in resent), \
        "the first session holds no record of the first stream's request, resent mid-stream"
    assert not stopped.active and stopped.num_records > 4 and not stopped.error
    assert second == reference_generate([9, 8, 7], 12, VOCAB, {0}, True)
    recording = Recording(tmp_path)
    assert [s.name for s in recording.sessions][0] == started.session and len(recording.sessions) == 2
    report = Replayer(shadow_executor(recorded(tmp_path))).run(recording)
    assert report.identical and report.num_compared > 10


def test_the_switch_over_http_needs_the_api_key_and_without_a_directory_there_is_none(tmp_path: Path):
    with hosted(shadow(), record=str(tmp_path), record_at_start=False, api_key=KEY) as h:
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{h.url}/admin/recording/start").status_code == 401
        started = httpx.post(f"{h.url}/admin/recording/start", headers=auth).json()
        status = httpx.get(f"{h.url}/admin/recording", headers=auth).json()
        stopped = httpx.post(f"{h.url}/admin/recording/stop", headers=auth).json()
        assert value(scrape(h.url, **auth), "recording_active") == 0
    assert started["active"] and status["session"] == started["session"] and not stopped["active"]
    assert [s.name for s in Recording(tmp_path).sessions] == [started["session"]]
    with hosted(shadow()) as h:
        refused = httpx.post(f"{h.url}/admin/recording/start")
        assert refused.status_code == 409 and "--record" in refused.json()["error"]["message"]
        with grpc.insecure_channel(f"{HOST}:{h.server.port}") as channel, pytest.raises(grpc.RpcError) as e:
            rpb_grpc.RecordingStub(channel).StartRecording(rpb.StartRecordingRequest())
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_full_disk_stops_the_recording_and_not_the_service(tmp_path: Path):
    with hosted(shadow(), record=str(tmp_path)) as h:
        first = h.stub.GenerateOnce(token_request([1, 2, 3], 8, ignore_eos=True)).token_ids
        session = h.server.recorder.session
        writer, written = session.writer, []
        deadline = time.monotonic() + 5
        while (session.queue or not writer.num_records) and time.monotonic() < deadline:
            time.sleep(0.01)  # the first request's records on disk

        def to_a_full_disk(records: list[bytes]) -> None:
            """On the writer's thread, from its next write on: every write fails with ENOSPC."""
            written.append(writer.num_bytes)
            writer._file.close()
            writer._file = open("/dev/full", "wb", buffering=0)  # noqa: SIM115
            writer.write = plain_write
            plain_write(records)

        plain_write, writer.write = writer.write, to_a_full_disk
        second = h.stub.GenerateOnce(token_request([4, 5, 6], 8, ignore_eos=True)).token_ids
        h.assert_idle()
        deadline = time.monotonic() + 5
        while (status := h.server.recording.status()).active and time.monotonic() < deadline:
            time.sleep(0.01)  # the writer's thread meets the full disk after the step that queued the records
        samples = scrape(h.url)
    assert list(first) == reference_generate([1, 2, 3], 8, VOCAB, {0}, True)
    assert list(second) == reference_generate([4, 5, 6], 8, VOCAB, {0}, True)
    assert not status.active and "No space left on device" in status.error
    assert value(samples, "recording_failures_total") == 1 and value(samples, "recording_active") == 0
    recording = Recording(tmp_path)  # what was written before reads whole
    assert recording.num_records > 0 and [sum(f.stat().st_size for f in recording.sessions[0].files)] == written


def test_the_split_stack_records_and_the_command_line_replays_it(tmp_path: Path):
    options = {"num_blocks": 64, "block_size": 4, "vocab_size": VOCAB, "eos_token_ids": 0}
    directory = tmp_path / "recording"
    port = free_port()
    with running_stack(executor_argv("shadow", port, options), tmp_path / "logs", port, record=directory,
                       record_max_file_bytes=1024) as stack:
        for prompt, n in (([1, 2, 3, 4, 5, 6, 7, 8, 9], 30), ([5, 6], 12)):
            response = stack.stub.GenerateOnce(token_request(prompt, n, ignore_eos=True), timeout=30)
            assert list(response.token_ids) == reference_generate(prompt, n, VOCAB, {0}, True)
        assert_idle(stack.stub)
    assert len(Recording(directory).sessions[0].files) > 1, "no rotation at 1 KiB"
    executor = spawn(executor_argv("shadow", port, options), tmp_path / "replay-executor.log")
    try:
        wait_serving(f"{HOST}:{port}", executor)
        remote = run_cli("replay", str(directory), "--executor", f"{HOST}:{port}", "--json")
    finally:
        stop_process(executor)
    in_process = run_cli("replay", str(directory), "--shadow", "--pace", "recorded")
    assert remote.returncode == 0, remote.stderr
    assert '"identical": true' in remote.stdout and '"divergence": null' in remote.stdout
    assert in_process.returncode == 0, in_process.stderr
    assert in_process.stdout.strip().endswith("identical") and "0 diverged" in in_process.stdout


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "client.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("with_text", [False, True], ids=["ids only", "--record-text"])
def test_the_tokenizer_stays_out_of_the_recording_unless_asked(tmp_path: Path, with_text: bool):
    tokenizer_json = byte_level_tokenizer().to_str()
    executor = ShadowExecutor(64, 4, TOKENIZER_VOCAB_SIZE, (0,), tokenizer_json=tokenizer_json)

    async def main():
        async with in_process_scheduler(executor, record=str(tmp_path), record_text=with_text) as s:
            return await generate(s.stub, [5, 6, 7], 4)

    assert asyncio.run(main()) == reference_generate([5, 6, 7], 4, TOKENIZER_VOCAB_SIZE, {0}, True)
    info = recorded(tmp_path)
    assert info.model_id == "shadow-kv" and info.num_blocks == 64
    assert info.tokenizer_json == (tokenizer_json if with_text else "")
    assert Recording(tmp_path).sessions[0].header.with_text is with_text

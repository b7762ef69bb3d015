"""What VllmEngine's info RPCs answer, from what the scheduler knows: the executor's handshake (``ExecutorInfo``), the
shared ``ServerInfo``, the prefix cache's event batches, and the tokenizer files the executor handed over."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from datetime import datetime, timezone

from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto.generated import common_pb2 as common

from common.step import ExecutorInfo
from scheduler_svc.api.server_info import ServerInfo
from scheduler_svc.core.kv_events import AllBlocksCleared, BlockStored, KvEvent
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.engine.kv_events import KvEventBatch

SERVER_TYPE = "nanoserve-grpc"
# GetTokenizer's chunks (the gateway's gRPC client reads up to this much per message).
TOKENIZER_CHUNK_BYTES = 64 << 10


def model_info(info: ExecutorInfo, served_model_name: str = "") -> vllm.GetModelInfoResponse:
    """``served_model_name``: what the gateway names the model by (--served-model-name's first; "": the model id)."""
    return vllm.GetModelInfoResponse(
        model_path=info.model_id, served_model_name=served_model_name or info.model_id, is_generation=True,
        max_context_length=info.max_model_len, max_req_input_len=info.max_model_len - 1, vocab_size=info.vocab_size,
        supports_vision=False, architectures=[info.architecture] if info.architecture else [],
        eos_token_ids=info.eos_token_ids, bos_token_id=info.bos_token_id or 0)


def server_info(s: ServerInfo, active_requests: int, last_request_at: float, reasoning_parser: str = "",
                grammar_waits: bool = False) -> vllm.GetServerInfoResponse:
    """``reasoning_parser``: --reasoning-parser; ``grammar_waits``: whether a grammar waits for its thinking's end
    (the vocabulary has the markers, ``api.thinking``)."""
    return vllm.GetServerInfoResponse(
        active_requests=active_requests, is_paused=False, last_receive_timestamp=last_request_at,
        uptime_seconds=s.uptime_s, server_type=SERVER_TYPE, data_parallel_size=1, kv_cache_dtype=s.dtype,
        block_size=s.block_size, model_dtype=s.dtype, max_num_seqs=s.max_num_seqs,
        engine_reasoning_parser=reasoning_parser,
        constrained_decoding_start="after_reasoning" if grammar_waits else "first_token")


def loads(s: ServerInfo) -> vllm.GetLoadsResponse:
    load = vllm.SchedulerLoad(
        dp_rank=0, num_running_reqs=s.num_running, num_waiting_reqs=s.num_waiting,
        num_total_reqs=s.num_running + s.num_waiting, num_used_tokens=s.num_used_blocks * s.block_size,
        max_total_num_tokens=s.num_kv_blocks * s.block_size, token_usage=s.kv_cache_usage,
        cache_hit_rate=s.prefix_cache_hit_rate, max_running_requests=s.max_num_seqs,
        num_waiting_uncached_tokens=s.num_queued_prompt_tokens)
    return vllm.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version=s.version,
                                 dp_rank_count=1, loads=[load])


def signed(block_hash: int) -> int:
    """The prefix cache's unsigned 64-bit hash in KvBlock's int64 (the same bits)."""
    return block_hash - (1 << 64) if block_hash >= 1 << 63 else block_hash


def kv_event(event_id: int, event: KvEvent) -> common.KvCacheEvent:
    if isinstance(event, BlockStored):
        size = event.block_size
        blocks = [common.KvBlock(block_hash=signed(h), token_ids=event.token_ids[i * size:(i + 1) * size],
                                 block_size=size, lora_id=event.lora_id) for i, h in enumerate(event.block_hashes)]
        stored = common.KvBlocksStored(blocks=blocks, lora_name=event.lora_name, cache_salt=event.cache_salt)
        if event.parent_block_hash is not None:
            stored.parent_block_hash = signed(event.parent_block_hash)
        return common.KvCacheEvent(event_id=event_id, stored=stored)
    if isinstance(event, AllBlocksCleared):
        return common.KvCacheEvent(event_id=event_id, cleared=common.KvCacheCleared())
    removed = common.KvBlocksRemoved(block_hashes=[signed(h) for h in event.block_hashes])
    return common.KvCacheEvent(event_id=event_id, removed=removed)


def kv_event_batch(batch: KvEventBatch) -> common.KvEventBatch:
    events = [kv_event(batch.first_event_id + i, event) for i, event in enumerate(batch.events)]
    return common.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, events=events)


def tokenizer_files(info: ExecutorInfo, tokenizer: ModelTokenizer) -> dict[str, str]:
    """The files a Hugging Face tokenizer folder holds, rebuilt from the handshake's tokenizer.json and template."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": info.max_model_len,
              "eos_token": tokenizer.eos_token or None, "bos_token": tokenizer.bos_token or None}
    eos_ids = list(info.eos_token_ids)
    eos = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    model = {"architectures": [info.architecture], "vocab_size": info.vocab_size,
             "max_position_embeddings": info.max_model_len, "eos_token_id": eos, "bos_token_id": info.bos_token_id}
    files = {"tokenizer.json": info.tokenizer_json, "config.json": json.dumps(model, indent=1),
             "generation_config.json": json.dumps({"eos_token_id": eos_ids, "bos_token_id": info.bos_token_id})}
    if info.chat_template:
        config["chat_template"] = info.chat_template
        files["chat_template.jinja"] = info.chat_template
    files["tokenizer_config.json"] = json.dumps(config, indent=1)
    return files


def tokenizer_chunks(files: dict[str, str]) -> list[common.GetTokenizerChunk]:
    """The files as one zip, in chunks; the last carries the zip's SHA-256."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in sorted(files.items()):
            archive.writestr(name, text)
    data = buffer.getvalue()
    pieces = [data[i:i + TOKENIZER_CHUNK_BYTES] for i in range(0, len(data), TOKENIZER_CHUNK_BYTES)]
    chunks = [common.GetTokenizerChunk(data=piece) for piece in pieces]
    chunks[-1].sha256 = hashlib.sha256(data).hexdigest()
    return chunks

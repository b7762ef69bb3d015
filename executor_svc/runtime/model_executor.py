"""The real executor: a Hugging Face llama-family model behind the step-plan contract.

``RequestTable`` validates and applies each plan (a rejected plan changes
nothing), the model runner launches each forward pass and finishes it (waits,
samples), and the table records the sampled tokens (``steps.TableExecutor``:
on a GPU, the next step is launched before they are). Under tensor
parallelism this object lives on rank 0 and the other ranks are worker
processes it starts and stops.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import torch

from common.step import ExecutorInfo, LoraAdapterInfo, StepResult
from executor_svc.core.request_table import RequestTable, ScheduledChunk
from executor_svc.core.step_pipeline import TableExecutor
from executor_svc.lora.adapter import LoraError
from executor_svc.lora.manager import LoraManager
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.distributed import free_init_method, init_group, spawn_workers, tp_size
from executor_svc.runtime.hf_folder import (
    generation_defaults,
    read_chat_template,
    read_tokenizer_json,
    special_tokens,
)
from executor_svc.runtime.model_runner import LaunchedForward, ModelRunner, PreparedInput, rank_device, worker_main
from executor_svc.runtime.registry import resolve_model
from executor_svc.sample.sampler import SamplerOutput
from executor_svc.spec.draft import check_draft_options


class ModelExecutor(TableExecutor):
    def __init__(self, options: ExecutorOptions | None = None) -> None:
        super().__init__()
        self.options = options = options or ExecutorOptions()
        self.folder = resolve_model(options.model)
        check_draft_options(options)
        self.workers = []
        if options.tensor_parallel_size > 1:
            init_method = free_init_method()
            world = options.tensor_parallel_size
            self.workers = spawn_workers(worker_main, world, (world, init_method, str(self.folder), options))
            init_group(0, world, init_method, rank_device(options.resolved_device(), 0))
        self.runner = runner = ModelRunner(self.folder, options)
        self.prepares_ahead = runner.device.type != "cpu"
        config = runner.config
        self.table = RequestTable(runner.num_blocks, runner.block_size, config.vocab_size, runner.max_model_len)
        self.table.verifies_drafts = True
        self.table.has_draft_model = runner.draft is not None
        if runner.lora is not None:
            self.table.lora_ids = runner.lora.ids
        self.info = ExecutorInfo(
            instance_id=uuid.uuid4().hex,
            model_id=options.model,
            architecture=config.architecture,
            dtype=str(runner.dtype).removeprefix("torch."),
            device=str(runner.device),
            vocab_size=config.vocab_size,
            eos_token_ids=tuple(config.eos_token_ids),
            bos_token_id=config.bos_token_id,
            max_model_len=runner.max_model_len,
            block_size=runner.block_size,
            num_blocks=runner.num_blocks,
            tensor_parallel_size=options.tensor_parallel_size,
            tokenizer_json=(tokenizer_json := read_tokenizer_json(self.folder)),
            chat_template=read_chat_template(self.folder),
            attention_backend=runner.backend.name,
            lora_adapters=self.lora_adapters(),
            max_lora_rank=options.max_lora_rank if runner.lora is not None else 0,
            runtime_lora=options.runtime_lora,
            draft_model_id=runner.draft.model_id if runner.draft is not None else "",
            special_tokens=special_tokens(self.folder, tokenizer_json, {
                "bos_token": config.bos_token_id, "eos_token": next(iter(config.eos_token_ids), None)}),
            generation_defaults=generation_defaults(self.folder),
        )

    def lora_adapters(self) -> tuple[LoraAdapterInfo, ...]:
        """The adapters held now, by id."""
        lora = self.runner.lora
        held = sorted(lora.adapters.values(), key=lambda a: a.lora_id) if lora is not None else []
        return tuple(LoraAdapterInfo(a.lora_id, a.name, a.path, a.rank) for a in held)

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        """Load adapter ``name`` from the PEFT folder ``path`` while serving; LoraError, changing nothing, if runtime
        loading is off or the adapter does not fit (the executor keeps serving either way)."""
        lora = self._runtime_lora()
        loaded = lora.load(name, path)
        self.table.lora_ids = lora.ids
        self.info = replace(self.info, lora_adapters=self.lora_adapters())
        return LoraAdapterInfo(loaded.lora_id, loaded.name, loaded.path, loaded.rank)

    def unload_lora(self, name: str) -> LoraAdapterInfo:
        """Unload adapter ``name``; LoraInUse, changing nothing, while a held request runs through it."""
        lora = self._runtime_lora()
        loaded = lora.adapters.get(name)
        if loaded is None:
            raise LoraError(f"adapter {name!r} is not loaded", "NOT_FOUND")
        if not self.table.retire_lora(loaded.lora_id):
            raise LoraError(f"adapter {name!r} serves running requests; unload it once they finish",
                            "FAILED_PRECONDITION")
        lora.unload(name)
        self.info = replace(self.info, lora_adapters=self.lora_adapters())
        return LoraAdapterInfo(loaded.lora_id, loaded.name, loaded.path, loaded.rank)

    def _runtime_lora(self) -> LoraManager:
        if not self.options.runtime_lora or self.runner.lora is None:
            raise LoraError("loading and unloading adapters at run time is off (start the executor with "
                            "--runtime-lora)", "FAILED_PRECONDITION")
        if tp_size() > 1:
            # The other ranks follow rank 0's broadcasts in step order, which a call from another thread would break.
            raise LoraError("adapters load at run time on one rank only; under tensor parallelism pass them with "
                            "--lora-modules at start", "FAILED_PRECONDITION")
        return self.runner.lora

    def pack(self, chunks: list[ScheduledChunk], before: list[ScheduledChunk] | None = None) -> PreparedInput | None:
        if any(chunk.num_drafts for chunk in chunks):
            return None  # packed at launch, once the draft model has proposed and the step before is recorded
        prepared = self.runner.prepare(chunks)
        prepared.model_input.link(before)
        return prepared

    def launches_ahead(self, inputs: PreparedInput | None) -> bool:
        return inputs is not None and self.runner.launches_async(inputs.model_input)

    def fills_ahead(self, inputs: PreparedInput | None) -> bool:
        return inputs is not None and inputs.model_input.linked is not None

    def samples_ahead(self, launched: LaunchedForward) -> bool:
        return launched.ahead is not None

    def launch(self, chunks: list[ScheduledChunk], inputs: PreparedInput | None = None,
               sampled_before: list[int] | None = None, behind: LaunchedForward | None = None) -> LaunchedForward:
        """The forward pass started: on a GPU its kernels are queued while the CPU carries on; on the CPU it has run."""
        return self.runner.launch(chunks, inputs, sampled_before, behind)

    def finish(self, launched: LaunchedForward) -> StepResult:
        """The sampled tokens of a launched forward pass: 0, and no logprobs, for a chunk short of its end."""
        sampled, prompt_logprobs, forward_ms, sample_ms = self.runner.finish(launched)
        chunks = launched.chunks
        if sampled.counts:
            return self._verified(chunks, sampled, StepResult([], [], forward_ms, sample_ms, prompt_logprobs))
        if len(sampled.token_ids) == len(chunks):  # every chunk sampled (a decode step): no walk over the chunks
            return StepResult(list(sampled.token_ids), list(sampled.logprobs), forward_ms, sample_ms, prompt_logprobs)
        token_ids = iter(sampled.token_ids)
        output = StepResult([next(token_ids) if chunk.samples else 0 for chunk in chunks], [], forward_ms, sample_ms,
                            prompt_logprobs)
        if sampled.logprobs:
            logprobs = iter(sampled.logprobs)
            output.logprobs = [next(logprobs) if chunk.samples else None for chunk in chunks]
        return output

    @staticmethod
    def _verified(chunks: list[ScheduledChunk], sampled: SamplerOutput, output: StepResult) -> StepResult:
        """``finish`` for a step that verified proposals: each chunk's tokens (a 0 for one short of its end), and
        how many (``StepResult.num_sampled_tokens``)."""
        counts = iter(sampled.counts)
        at = 0
        for chunk in chunks:
            n = next(counts) if chunk.samples else 0
            output.token_ids += sampled.token_ids[at : at + n] if n else [0]
            if sampled.logprobs:
                output.logprobs += sampled.logprobs[at : at + n] if n else [None]
            output.num_sampled_tokens.append(max(n, 1))
            at += n
        return output

    def forward(self, chunks: list[ScheduledChunk], inputs: PreparedInput | None = None) -> StepResult:
        """One forward pass and sampling over ``chunks``, waited for at once."""
        return self.finish(self.launch(chunks, inputs))

    def close(self) -> None:
        """Stop the tensor-parallel workers (rank 0 only has work to do)."""
        if self.workers:
            self.runner.stop_workers()
            for worker in self.workers:
                worker.join(timeout=30)
            torch.distributed.destroy_process_group()
            self.workers = []

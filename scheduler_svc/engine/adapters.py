"""The LoRA adapters the executor holds, as the scheduler knows them: names (what requests say) to ids (what plans
and the prefix cache say), learned from the handshake and from each load and unload the scheduler passes on.

An unload is vLLM's: the name is refused to new requests at once, while the requests already through it run to
their end; the adapter retires, and the executor drops its weights once none of them is left (``retire``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from common.executor import Executor, LoraRefused
from common.step import ExecutorInfo, LoraAdapterInfo
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sequence import Sequence

log = logging.getLogger(__name__)


def loads_at_run_time(info: ExecutorInfo) -> bool:
    """Whether the executor loads and unloads adapters while serving (on one rank only)."""
    return info.runtime_lora and info.tensor_parallel_size == 1


class Adapters:
    """Adapters by name; the base model is the empty name, or the served model's own name, id 0."""

    def __init__(self, adapters: Iterable[LoraAdapterInfo], base_name: str, runtime: bool = False) -> None:
        self.base_name = base_name
        self.by_name = {a.name: a for a in adapters}
        # Unloaded, and so refused to new requests, but still the executor's while requests run through them.
        self.retiring: dict[str, LoraAdapterInfo] = {}
        self.runtime = runtime

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def lora_id(self, name: str | None) -> int:
        """The id a request for ``name`` runs under; InvalidRequest naming the field ``lora`` if none is served."""
        if not name or name == self.base_name:
            return 0
        adapter = self.by_name.get(name)
        if adapter is None:
            known = ", ".join(self.names()) or "none"
            raise InvalidRequest("lora", f"no LoRA adapter named {name!r} is loaded (loaded: {known})")
        return adapter.lora_id

    def name_of(self, lora_id: int) -> str:
        """The adapter's name ("" for the base model), retiring ones' too."""
        return next((a.name for a in self._held() if a.lora_id == lora_id), "")

    def load(self, executor: Executor, name: str, path: str, live: Iterable[Sequence] = (),
             inplace: bool = False) -> LoraAdapterInfo:
        """Have ``executor`` load an adapter (LoraRefused if it will not); requests may name it from now on.
        ``inplace``: an adapter served under ``name`` is replaced, unless a ``live`` sequence runs through it."""
        if name in self.retiring:
            raise LoraRefused(f"adapter {name!r} is being unloaded and requests still run through it; load it again "
                              "once they finish", "FAILED_PRECONDITION")
        old = self.by_name.get(name) if inplace else None
        if old is not None:
            if any(seq.lora_id == old.lora_id for seq in live):
                raise LoraRefused(f"adapter {name!r} serves waiting or running requests; replace it once they "
                                  "finish", "FAILED_PRECONDITION")
            executor.unload_lora(name)
            del self.by_name[name]
        try:
            adapter = self.by_name[name] = executor.load_lora(name, path)
        except LoraRefused:
            if old is not None:  # the replacement does not fit: the adapter it was to replace serves on
                self.by_name[name] = executor.load_lora(name, old.path)
            raise
        return adapter

    def unload(self, name: str) -> LoraAdapterInfo:
        """Refuse ``name`` to new requests from now on; the executor drops it once requests through it are over
        (``retire``). LoraRefused if no adapter is served under ``name``, or the executor cannot unload."""
        adapter = self.by_name.get(name)
        if adapter is None:
            raise LoraRefused(f"adapter {name!r} is not loaded", "NOT_FOUND")
        if not self.runtime:
            raise LoraRefused("loading and unloading adapters at run time is off (start the executor with "
                              "--runtime-lora, and without tensor parallelism)", "FAILED_PRECONDITION")
        self.retiring[name] = self.by_name.pop(name)
        return adapter

    def retire(self, executor: Executor, live: Iterable[Sequence]) -> None:
        """Have ``executor`` drop each retiring adapter no ``live`` sequence runs through. The executor refuses while
        it still holds a request that ended through it (the next plan drops it): that one is asked again later."""
        busy = {seq.lora_id for seq in live}
        for name, adapter in list(self.retiring.items()):
            if adapter.lora_id in busy:
                continue
            try:
                executor.unload_lora(name)
            except LoraRefused as e:
                if e.code == "FAILED_PRECONDITION":
                    continue
                log.warning("LoRA adapter %r: %s", name, e)  # NOT_FOUND: the executor holds it no longer
            del self.retiring[name]

    def renumber(self, executor: Executor, seqs: list[Sequence], info: ExecutorInfo) -> list[Sequence]:
        """A restarted executor holds only the adapters it was started with, numbered afresh: it loads again those
        loaded at run time that requests may still name (served, or retiring with requests through them), and each
        live sequence takes its adapter's new id. Returns those whose adapter it could not load."""
        self.runtime = loads_at_run_time(info)
        held = {a.name: a for a in info.lora_adapters}
        old = {a.lora_id: a for a in self._held()}
        busy = {seq.lora_id for seq in seqs}
        wanted = [*self.by_name.values(), *(a for a in self.retiring.values() if a.lora_id in busy)]
        for adapter in wanted:
            if adapter.name not in held and self.runtime:
                try:
                    held[adapter.name] = executor.load_lora(adapter.name, adapter.path)
                except LoraRefused as e:
                    log.warning("LoRA adapter %r could not be loaded again on the restarted executor: %s",
                                adapter.name, e)
        self.retiring = {name: held[name] for name in self.retiring if name in held}
        self.by_name = {name: a for name, a in held.items() if name not in self.retiring}
        lost = []
        for seq in seqs:
            if seq.lora_id:
                adapter = held.get(old[seq.lora_id].name) if seq.lora_id in old else None
                if adapter is None:
                    lost.append(seq)
                else:
                    seq.lora_id = adapter.lora_id
        return lost

    def _held(self) -> list[LoraAdapterInfo]:
        return [*self.by_name.values(), *self.retiring.values()]

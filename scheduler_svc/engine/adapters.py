"""The LoRA adapters the executor holds, as the scheduler knows them: names (what requests say) to ids (what plans
and the prefix cache say), learned from the handshake and from each load and unload the scheduler passes on.

An unload is vLLM's: the name is refused to new requests at once, while the requests already through it run to
their end; the adapter retires, and the executor drops its weights once none of them is left (``retire``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

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
        # Every id's name, retired ones' too (a cache event may name an adapter after it retired).
        self.name_by_id = {a.lora_id: a.name for a in self.by_name.values()}
        # Unloaded by name since the start: a restarted executor that loads one at its start unloads it again.
        self.unloaded: set[str] = set()

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
        """The adapter's name ("" for the base model), retired ones' too."""
        return self.name_by_id.get(lora_id, "")

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
        try:
            adapter = executor.load_lora(name, path)
        except LoraRefused:
            if old is not None:  # the replacement does not fit: the adapter it was to replace serves on
                self._add(executor.load_lora(name, old.path))
            raise
        return self._add(adapter)

    def _add(self, adapter: LoraAdapterInfo) -> LoraAdapterInfo:
        self.by_name[adapter.name] = adapter
        self.name_by_id[adapter.lora_id] = adapter.name
        self.unloaded.discard(adapter.name)
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
        self.unloaded.add(name)
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
        """A restarted executor holds only the adapters it was started with, numbered afresh: the loads, unloads and
        replacements made since are made again (an adapter that requests may still name loaded again, from the
        folder it was last loaded from), and each live sequence takes its adapter's new id. Returns those whose
        adapter it could not load."""
        self.runtime = loads_at_run_time(info)
        held = {a.name: a for a in info.lora_adapters}
        old = {a.lora_id: a for a in self._held()}
        busy = {seq.lora_id for seq in seqs}
        wanted = [*self.by_name.values(), *(a for a in self.retiring.values() if a.lora_id in busy)]
        if self.runtime:
            for name in self.unloaded & held.keys() - {a.name for a in wanted}:
                self._try(executor.unload_lora, name)
                del held[name]
            for adapter in wanted:
                if adapter.name in held and held[adapter.name].path != adapter.path:  # replaced in place since
                    self._try(executor.unload_lora, adapter.name)
                    del held[adapter.name]
                if adapter.name not in held and (loaded := self._try(executor.load_lora, adapter.name, adapter.path)):
                    held[adapter.name] = loaded
        self.name_by_id.update({a.lora_id: a.name for a in held.values()})
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

    @staticmethod
    def _try(call: Callable[..., LoraAdapterInfo], *args: str) -> LoraAdapterInfo | None:
        """An adapter call to a restarted executor, its refusal logged: serving goes on without it."""
        try:
            return call(*args)
        except LoraRefused as e:
            log.warning("LoRA adapter %r on the restarted executor: %s", args[0], e)
            return None

    def _held(self) -> list[LoraAdapterInfo]:
        return [*self.by_name.values(), *self.retiring.values()]

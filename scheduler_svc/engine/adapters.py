"""The LoRA adapters the executor holds, as the scheduler knows them: names (what requests say) to ids (what plans
and the prefix cache say), learned from the handshake and from each load and unload the scheduler passes on."""

from __future__ import annotations

from collections.abc import Iterable

from common.executor import Executor, LoraRefused
from common.step import LoraAdapterInfo
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sequence import Sequence


class Adapters:
    """Adapters by name; the base model is the empty name, or the served model's own name, id 0."""

    def __init__(self, adapters: Iterable[LoraAdapterInfo], base_name: str) -> None:
        self.base_name = base_name
        self.by_name = {a.name: a for a in adapters}

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def names(self) -> list[str]:
        return sorted(self.by_name)

    def lora_id(self, name: str | None) -> int:
        """The id a request for ``name`` runs under; InvalidRequest naming the field ``lora`` if none is loaded."""
        if not name or name == self.base_name:
            return 0
        adapter = self.by_name.get(name)
        if adapter is None:
            known = ", ".join(self.names()) or "none"
            raise InvalidRequest("lora", f"no LoRA adapter named {name!r} is loaded (loaded: {known})")
        return adapter.lora_id

    def name_of(self, lora_id: int) -> str:
        """The adapter's name ("" for the base model)."""
        return next((a.name for a in self.by_name.values() if a.lora_id == lora_id), "")

    def load(self, executor: Executor, name: str, path: str) -> LoraAdapterInfo:
        """Have ``executor`` load an adapter (LoraRefused if it will not); requests may name it from now on."""
        adapter = self.by_name[name] = executor.load_lora(name, path)
        return adapter

    def unload(self, executor: Executor, name: str, live: Iterable[Sequence]) -> LoraAdapterInfo:
        """Have ``executor`` unload an adapter; LoraRefused, disturbing nothing, while a ``live`` sequence (waiting or
        running) runs through it: it would be refused by the executor, or computed without its adapter."""
        adapter = self.by_name.get(name)
        if adapter is not None and any(seq.lora_id == adapter.lora_id for seq in live):
            raise LoraRefused(f"adapter {name!r} serves waiting or running requests; unload it once they finish",
                              "FAILED_PRECONDITION")
        adapter = executor.unload_lora(name)
        del self.by_name[name]
        return adapter

    def renumber(self, seqs: Iterable[Sequence], adapters: Iterable[LoraAdapterInfo]) -> list[Sequence]:
        """A restarted executor numbers its adapters afresh: each live sequence takes its adapter's new id; returns
        those whose adapter it no longer holds."""
        old = {a.lora_id: a.name for a in self.by_name.values()}
        self.by_name = {a.name: a for a in adapters}
        lost = []
        for seq in seqs:
            if seq.lora_id:
                adapter = self.by_name.get(old.get(seq.lora_id, ""))
                if adapter is None:
                    lost.append(seq)
                else:
                    seq.lora_id = adapter.lora_id
        return lost

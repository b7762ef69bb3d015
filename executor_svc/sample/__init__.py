"""Turning logits into tokens: the sampler, logits processors (penalties, bias, min_tokens), grammar constraints and
prompt logprobs.
"""

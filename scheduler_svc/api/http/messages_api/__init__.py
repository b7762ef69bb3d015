"""Anthropic's Messages API (``/v1/messages``) over the chat route's code, as vLLM serves it."""

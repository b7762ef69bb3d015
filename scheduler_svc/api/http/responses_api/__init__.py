"""OpenAI's Responses API (``/v1/responses``) over the chat route's code, as vLLM serves it."""

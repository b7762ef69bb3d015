"""Building blocks of the llama-family model, tensor-parallel where they hold weights."""

"""Attention backends over one paged KV layout (see ``base.py``)."""

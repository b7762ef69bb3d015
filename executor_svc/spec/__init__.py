"""Speculative decoding in the executor: verifying a step's proposals (``verify``) and the draft model that makes
its own (``draft``). docs/executor.md explains the acceptance rule and why outputs stay exact.
"""

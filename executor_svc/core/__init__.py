"""The executor's core on ``common.step``'s plain types: the request table updated from plan deltas, and the step
pipeline that runs a plan's forward passes. No protobuf: the servicer (``executor_svc.service``) translates at the
edge with ``common.step_codec``.
"""

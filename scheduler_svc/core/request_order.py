"""The order requests wait and run in: arrival (``fcfs``, nano-vLLM's) or ``priority`` (vLLM's
``--scheduling-policy priority``): the lowest ``priority`` value first, arrival breaking ties.

Under ``priority`` both of the scheduler's queues stay sorted so: prefill takes the head of ``waiting`` and decode
takes ``running`` from its head, so a request that matters more is admitted first, and the tail of ``running``, which
preemption takes (as under ``fcfs``), is the request that matters least, the latest of those, as vLLM preempts. A
prompt part-way through its chunks keeps the head of ``waiting``: it holds the blocks of its whole prompt.
"""

from __future__ import annotations

from collections import deque

from scheduler_svc.core.sequence import Sequence, SequenceStatus


def priority_key(seq: Sequence) -> tuple[int, int, int]:
    """Lower runs first: the priority, then the request's arrival (sequence ids grow as requests arrive; the other
    choices of an n > 1 request, queued once the first one's prompt is computed, keep its arrival, as vLLM's children
    keep their parent's), then the choice."""
    return seq.priority, seq.arrival, seq.seq_id


def insert_by_priority(queue: deque[Sequence], seq: Sequence) -> None:
    """Put ``seq`` in ``queue`` (sorted by ``priority_key``) after every sequence that goes before it, and never ahead
    of a head already holding blocks (a prompt part-way through its chunks)."""
    key = priority_key(seq)
    start = 1 if queue and queue[0].status is SequenceStatus.WAITING and queue[0].block_table else 0
    index = len(queue)  # from the tail, where most go: requests of one priority arrive in order
    while index > start and key < priority_key(queue[index - 1]):
        index -= 1
    queue.insert(index, seq)


def enqueue(queue: deque[Sequence], seq: Sequence, by_priority: bool, front: bool = False) -> None:
    """``seq`` into ``queue``: last (``front``: first, as a preempted one goes back) in arrival order, in its place in
    priority order."""
    if by_priority:
        insert_by_priority(queue, seq)
    elif front:
        queue.appendleft(seq)
    else:
        queue.append(seq)

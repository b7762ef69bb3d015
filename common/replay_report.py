"""A replay's report (``common.replay``) as a table for people and as JSON for scripts."""

from __future__ import annotations

from dataclasses import asdict

from tokenizers import Tokenizer

from common.replay import ReplayReport, RequestReport
from common.step import ExecutorInfo

# Plans and diverged requests listed in the table; the JSON lists every one.
MAX_ROWS = 40


def describe_executor(info: ExecutorInfo) -> str:
    return f"{info.model_id} ({info.architecture}, {info.dtype}, {info.device}, attention {info.attention_backend})"


def token_namer(infos: list[ExecutorInfo]):
    """Token ids as ``id 'text'`` where the recording kept the tokenizer (--record-text), else as ids."""
    tokenizer_json = next((info.tokenizer_json for info in infos if info.tokenizer_json), "")
    if not tokenizer_json:
        return str
    tokenizer = Tokenizer.from_str(tokenizer_json)
    return lambda token_id: f"{token_id} {tokenizer.decode([token_id], skip_special_tokens=False)!r}"


def request_name(report: ReplayReport, request: RequestReport) -> str:
    """The request id, with its session where the recording holds several (ids restart with each scheduler)."""
    return f"{request.session}:{request.request_id}" if report.num_sessions > 1 else str(request.request_id)


def render(report: ReplayReport) -> str:
    name = token_namer(report.recorded_executors)
    recorded = {describe_executor(info) for info in report.recorded_executors}
    lines = [
        f"replayed {report.num_plans} plans of {report.num_sessions} session(s) on "
        f"{describe_executor(report.executor)}",
        f"recorded on {', '.join(sorted(recorded)) or 'an executor with no handshake'}",
        f"{report.num_compared} results compared, {report.num_identical} identical; {report.num_dropped} plans the "
        f"recorded executor dropped unrun; {report.num_restarts} executor restarts, {report.num_resets} resets",
        f"recorded over {report.recorded_s:.2f}s, replayed in {report.replay_s:.2f}s",
    ]
    lines += [f"warning: {warning}" for warning in dict.fromkeys(report.warnings)]
    for issue in report.issues[:MAX_ROWS]:
        kind = "differs" if issue.difference else "note"
        lines.append(f"step {issue.step_id} ({kind}): recorded {issue.recorded}; replay {issue.replayed}")
    if len(report.issues) > MAX_ROWS:
        lines.append(f"... and {len(report.issues) - MAX_ROWS} more plans (--json lists every one)")
    diverged = report.diverged
    lines.append(f"{len(report.requests)} requests compared, {len(diverged)} diverged")
    rows = [["request", "tokens", "first divergence", "recorded", "replayed", "max |dlogprob|"]]
    for request in diverged[:MAX_ROWS]:
        d = request.divergence
        rows.append([request_name(report, request), str(request.num_tokens), f"step {d.step_id}, position {d.position}",
                     name(d.recorded), name(d.replayed), logprob_text(request)])
    if len(rows) > 1:
        lines += table(rows)
        if len(diverged) > MAX_ROWS:
            lines.append(f"... and {len(diverged) - MAX_ROWS} more (--json lists every request)")
    logprobs = [r.max_logprob_diff for r in report.requests.values() if r.max_logprob_diff is not None]
    if logprobs:
        lines.append(f"largest logprob difference before any divergence: {max(logprobs):.3g}")
    lines.append("identical" if report.identical else "DIFFERENT")
    return "\n".join(lines)


def logprob_text(request: RequestReport) -> str:
    return "-" if request.max_logprob_diff is None else f"{request.max_logprob_diff:.3g}"


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def executor_json(info: ExecutorInfo) -> dict:
    """The handshake without the tokenizer and template (large, and text)."""
    fields = asdict(info)
    for name in ("tokenizer_json", "chat_template"):
        fields.pop(name)
    return fields


def to_json(report: ReplayReport) -> dict:
    return {
        "identical": report.identical,
        "executor": executor_json(report.executor),
        "recorded_executors": [executor_json(info) for info in report.recorded_executors],
        "sessions": report.num_sessions,
        "plans": report.num_plans,
        "compared": report.num_compared,
        "identical_results": report.num_identical,
        "dropped": report.num_dropped,
        "restarts": report.num_restarts,
        "resets": report.num_resets,
        "recorded_s": report.recorded_s,
        "replay_s": report.replay_s,
        "warnings": list(dict.fromkeys(report.warnings)),
        "issues": [asdict(issue) for issue in report.issues],
        "requests": [asdict(request) for request in report.requests.values()],
    }

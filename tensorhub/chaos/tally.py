"""What a campaign counts, and its JSON form:

    {"faults": {kind: n}, "skipped": {kind: n}, "pulls_ok": n, "idle_pulls": n,
     "failures": {ErrorType: n}, "untyped": [...], "mismatches": n, "mismatch_details": [...],
     "checks_failed": {"by_source": n, "unplaced": n}, "checks_failed_details": [{"who", "version", ...}],
     "served_changed": n, "served_changed_details": [{"who", "version", "tensors", "after_s"}],
     "hangs": n, "hang_details": [{"who", "op", "seconds", "stacks"}], "crashes": n,
     "unpublishes": n, "unpublish_overruns": n, "unpublish_max_s": s, "late_ops": n,
     "versions": n, "leaks": {...}, "leak_details": [{"who", "new_threads"}], "logs": folder or null, "seed": s, "minutes": m, "seconds": s, "phases": {...},
     "applied": [[at_s, kind, target, duration_s]], "failure_log": [[at_s, who, op, type, message]]}

A failure is typed when it is a ``TensorHubError``; anything else counts under
``failures`` as ``UNTYPED:<Type>`` and its traceback goes to ``untyped``.
A campaign is clean with no mismatch, changed served bytes, hang, untyped
failure, crash or leak; else its workers' logs are kept (``logs``).
``checks_failed`` counts chunks of pulls that ended byte-exact whose bytes
failed their checksum check first and were read again: wrong bytes the checks
caught (``by_source``: one holder's, excluded; ``unplaced``: read from several
holders, nobody to blame). Not a defect of the pull; a sign of one elsewhere.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True, slots=True)
class Tally:
    seed: int
    minutes: float
    unpublish_timeout_s: float
    faults: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    pulls_ok: int = 0
    idle_pulls: int = 0
    failures: Counter = field(default_factory=Counter)
    untyped: list[dict] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)  # one message per failure type
    overrun_details: list[dict] = field(default_factory=list)
    mismatches: int = 0
    mismatch_details: list[dict] = field(default_factory=list)
    checks_failed: Counter = field(default_factory=Counter)  # caught by the checks, read again
    checks_failed_details: list[dict] = field(default_factory=list)
    # A reader's replica whose bytes were right when its pull ended and wrong when
    # it stopped serving them: written after the pull (a defect, like a mismatch).
    served_changed: int = 0
    served_changed_details: list[dict] = field(default_factory=list)
    hangs: int = 0
    hang_details: list[dict] = field(default_factory=list)
    crashes: int = 0
    crash_details: list[str] = field(default_factory=list)
    unpublishes: int = 0
    unpublish_overruns: int = 0
    unpublish_max_s: float = 0.0
    late_ops: int = 0  # operations (pulls, steps, ...) that ended past the deadlines they were given
    failure_log: list[list] = field(default_factory=list)  # [at_s, who, op, type, message start]
    versions: int = 0
    bytes_pulled: int = 0
    leaks: dict[str, int] = field(default_factory=dict)
    leak_details: list[dict] = field(default_factory=list)  # a process's threads started since it was warm
    logs: str | None = None  # the workers' logs, kept when the campaign is not clean
    applied: list[list] = field(default_factory=list)  # [at_s, kind, target, duration_s]
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds of start-up, faults, settle, drain, close

    def answer(self, who: str, answer: dict[str, Any], elapsed_s: float, allowed_s: float) -> None:
        """Count one operation's answer (see worker.py)."""
        for seconds in answer.get("unpublish_s", []):
            self.unpublishes += 1
            self.unpublish_max_s = max(self.unpublish_max_s, seconds)
            if seconds > self.unpublish_timeout_s + 0.5:  # its own timeout (and scheduling noise on 2 cores)
                self.unpublish_overruns += 1
                self.overrun_details.append({"who": who, "op": answer.get("op"), "seconds": round(seconds, 2),
                                             "errors": answer.get("unpublish_messages", [])})
        for name, message in zip(answer.get("unpublish_errors", []), answer.get("unpublish_messages", [])):
            self.failures[name] += 1
            self.examples.setdefault(name, message)
        if elapsed_s > allowed_s:
            self.late_ops += 1
        if answer.get("changed_while_served"):
            self.served_changed += 1
            self.served_changed_details.append({"who": who, **answer["changed_while_served"]})
        if "error" in answer:
            self.failure(who, answer)
        elif answer.get("idle"):
            self.idle_pulls += 1
        elif answer.get("op") == "pull":
            if answer.get("mismatched"):
                self.mismatches += 1
                self.mismatch_details.append({"who": who, "version": answer.get("version"),
                                              "tensors": answer["mismatched"], "sources": answer.get("sources"),
                                              "unverified": answer.get("unverified"), "lost": answer.get("lost")})
            else:
                self.pulls_ok += 1
                self.bytes_pulled += answer.get("nbytes", 0)
            self._caught(who, answer)

    def _caught(self, who: str, answer: dict[str, Any]) -> None:
        failed, unplaced = answer.get("checks_failed", 0), answer.get("checks_unplaced", 0)
        if not failed:
            return
        by_source = failed - unplaced
        self.checks_failed["by_source"] += by_source
        self.checks_failed["unplaced"] += unplaced
        if len(self.checks_failed_details) < 20:
            self.checks_failed_details.append({"who": who, "version": answer.get("version"), "by_source":
                                               by_source, "unplaced": unplaced,
                                               "sources": answer.get("sources"), "lost": answer.get("lost")})

    def failure(self, who: str, answer: dict[str, Any]) -> None:
        name = answer["error"] if answer.get("typed") else f"UNTYPED:{answer['error']}"
        self.failures[name] += 1
        self.examples.setdefault(name, answer.get("message", ""))
        if len(self.failure_log) < 5000:
            self.failure_log.append([round(self.seconds, 1), who, answer.get("op"), name,
                                     answer.get("message", "")[:160]])
        if not answer.get("typed") and len(self.untyped) < 20:
            self.untyped.append({"who": who, "op": answer.get("op"), "error": answer["error"],
                                 "message": answer.get("message", ""), "traceback": answer.get("traceback", "")})

    @property
    def untyped_count(self) -> int:
        return sum(n for name, n in self.failures.items() if name.startswith("UNTYPED:"))

    @property
    def leaked(self) -> int:
        return sum(self.leaks.values())

    @property
    def clean(self) -> bool:
        return not (self.mismatches or self.served_changed or self.hangs or self.untyped_count or self.leaked
                    or self.crashes)

    def line(self) -> str:
        """The live line."""
        faults = " ".join(f"{k.split('_')[0]} {n}" for k, n in sorted(self.faults.items()))
        fails = sum(self.failures.values())
        return (f"{self.seconds:5.0f} s  faults {sum(self.faults.values())} ({faults})  v{self.versions}  "
                f"pulls ok {self.pulls_ok}  failed {fails} (untyped {self.untyped_count})  "
                f"mismatches {self.mismatches}{f' (served changed {self.served_changed})' if self.served_changed else ''}  "
                f"caught {sum(self.checks_failed.values())}  hangs {self.hangs}  crashes {self.crashes}  "
                f"unpublish max {self.unpublish_max_s:.1f} s")

    def to_json(self) -> dict[str, Any]:
        return {"faults": dict(self.faults), "skipped": dict(self.skipped), "pulls_ok": self.pulls_ok,
                "idle_pulls": self.idle_pulls, "failures": dict(self.failures), "untyped": self.untyped,
                "failure_examples": self.examples, "overrun_details": self.overrun_details[:20],
                "mismatches": self.mismatches, "mismatch_details": self.mismatch_details[:20],
                "checks_failed": {"by_source": self.checks_failed["by_source"],
                                  "unplaced": self.checks_failed["unplaced"]},
                "checks_failed_details": self.checks_failed_details,
                "served_changed": self.served_changed, "served_changed_details": self.served_changed_details[:20],
                "hangs": self.hangs,
                "hang_details": self.hang_details, "crashes": self.crashes, "crash_details": self.crash_details[:20],
                "unpublishes": self.unpublishes, "unpublish_overruns": self.unpublish_overruns,
                "unpublish_max_s": round(self.unpublish_max_s, 3), "late_ops": self.late_ops,
                "versions": self.versions, "bytes_pulled": self.bytes_pulled, "leaks": self.leaks,
                "leak_details": self.leak_details[:20], "logs": self.logs,
                "seed": self.seed, "minutes": self.minutes, "seconds": round(self.seconds, 1),
                "phases": {k: round(v, 1) for k, v in self.phases.items()},
                "applied": self.applied, "failure_log": self.failure_log}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

"""The call gate: whole calls without the drafter where drafting bought nothing (TensorRT-LLM's acceptance gate, by
call). A call whose choices by estimate never drafted paid the drafter's prompt pass for nothing: the next
`call_backoff` calls run without the drafter (vanilla's cost), doubling after each such call; the call after them
drafts again (`retrying`: a probe, its first segment explores again, the later ones only if an estimate drafts, its
steps timed afresh), so a verdict is measured again rather than kept for ever.
"""

from __future__ import annotations

from mmspec.budget.config import BudgetConfig


class CallGate:
    def __init__(self, config: BudgetConfig) -> None:
        self.config, self.skip = config, 0  # skip: calls left to run without the drafter
        self.backoff = config.call_backoff  # calls skipped after the next call that never drafts by estimate
        self.retrying = False  # the drafted call now or next follows skipped calls: a probe, until its estimate drafts
        self.calls = {"drafted": 0, "without_drafter": 0}

    def drafts_this_call(self) -> bool:
        """Whether the call starting now drafts (False: it runs without the drafter)."""
        if self.config.gate and self.skip > 0:
            self.skip -= 1
            self.retrying = self.skip == 0
            self.calls["without_drafter"] += 1
            return False
        self.calls["drafted"] += 1
        return True

    def end_call(self, estimated: int, drafted: int) -> None:
        """A drafted call made `estimated` choices by estimate, `drafted` of which drafted (a call of warm-up and
        exploration choices alone gives no verdict)."""
        self.retrying = False
        if estimated and not drafted:
            self.skip, self.backoff = self.backoff, 2 * self.backoff
        elif estimated:
            self.backoff = self.config.call_backoff

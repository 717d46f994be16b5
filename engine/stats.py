"""What an engine counts as it steps: steps, positions computed, preemptions, speculative drafts,
and the prompts it computes (the controller's role policy reads the demand off those)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    tokens_computed: int = 0  # positions run through the model (prompt chunks, decode, drafts)
    preemptions: int = 0
    per_request_computed: dict[str, int] = field(default_factory=dict)
    # speculative decoding: drafts verified and accepted, and (sequence, step) pairs that verified
    # at least one draft; accepted drafts / draft_seq_steps + 1 = tokens per verify step
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    draft_seq_steps: int = 0
    # prompts: positions computed (not cached, not received), prompts whose last position was
    # computed here, and their lengths (the controller's role policy reads the demand off them)
    prompt_tokens_computed: int = 0
    prompts_completed: int = 0
    prompt_tokens_completed: int = 0

    def count_prompts(self, scheduled) -> int:
        """Count a step's prompt positions and the prompts it completes (before the scheduler
        advances them); returns the positions."""
        positions = 0
        for x in scheduled:
            r = x.request
            if r.num_computed_tokens < r.num_prompt_tokens:
                positions += x.num_new_tokens
                if r.num_computed_tokens + x.num_new_tokens >= r.num_prompt_tokens:
                    self.prompts_completed += 1
                    self.prompt_tokens_completed += r.num_prompt_tokens
        self.prompt_tokens_computed += positions
        return positions

    def prompt_counters(self) -> dict[str, int]:
        return {"prompt_tokens_computed": self.prompt_tokens_computed, "prompts_completed": self.prompts_completed,
                "prompt_tokens_completed": self.prompt_tokens_completed}

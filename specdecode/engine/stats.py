"""Per-request statistics of speculative generation."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specdecode.core.theory import speedup


@dataclass(frozen=True, slots=True)
class RoundRecord:
    drafter: str  # who proposed ("none" for a plain decode step)
    drafted: int  # K this round
    accepted: int  # n
    emitted: int  # tokens kept (n + 1, fewer if EOS or max_new_tokens cut the round)
    t_draft: float
    t_verify: float
    verified: int = 0  # tokens in the target pass (drafted + 1, plus any padding)
    # draft positions that count as tested (None: min(accepted + 1, drafted), the positions up to
    # the first rejection); fewer when an EOS inside the accepted run ends the output early
    tested: int | None = None
    tree_nodes: int = 0  # a draft tree's nodes (0: a chain); drafted is then its chain's length
    off_chain: bool = False  # the tree's accepted path took an alternative, not the chain
    # the round's wall time as its sequence waited it: drafting, the pass, turning logits into tokens
    # (sampling, verification); t_draft + t_verify leave the last out (0.0: not measured)
    t_round: float = 0.0


def _tested(record: RoundRecord) -> int:
    """Draft positions a round tested, in the output's terms."""
    return min(record.accepted + 1, record.drafted) if record.tested is None else record.tested


@dataclass
class GenerationStats:
    """Counters of one request. Mutable: the engine adds a RoundRecord per round."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, already in the cache (a slot's or the prompt cache's): not computed
    new_tokens: int = 0
    t_prefill: float = 0.0
    finish_reason: str = "length"  # "stop": EOS or a stop string; "length": max_new_tokens or context full
    rounds: list[RoundRecord] = field(default_factory=list)
    # accepted_per_position[i]: rounds whose draft i+1 was accepted;
    # reached_per_position[i]: rounds in which draft i+1 was tested (all before it accepted)
    accepted_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)

    def add_round(self, record: RoundRecord) -> None:
        self.rounds.append(record)
        self.new_tokens += record.emitted
        reached = _tested(record)
        grow = reached - len(self.reached_per_position)
        if grow > 0:
            self.reached_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(reached):
            self.reached_per_position[i] += 1
            self.accepted_per_position[i] += int(i < record.accepted)

    def cut_output(self, total: int) -> None:
        """The output ends after its first `total` tokens (a stop string cut it): count only
        those, as new tokens and as accepted/tested drafts (as for an EOS inside a round)."""
        while self.new_tokens > total:
            record = self.rounds.pop()
            self.new_tokens -= record.emitted
            for i in range(_tested(record)):
                self.reached_per_position[i] -= 1
                self.accepted_per_position[i] -= int(i < record.accepted)
            kept = total - self.new_tokens
            if kept > 0:
                self.add_round(replace(record, emitted=kept, accepted=min(record.accepted, kept),
                                       tested=min(kept, _tested(record))))

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def speculative_rounds(self) -> list[RoundRecord]:
        return [r for r in self.rounds if r.drafted > 0]

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def t_draft(self) -> float:
        return sum(r.t_draft for r in self.rounds)

    @property
    def t_verify(self) -> float:
        return sum(r.t_verify for r in self.rounds)

    @property
    def t_decode(self) -> float:
        """Seconds the rounds took (prefill excluded): their wall time where measured."""
        return sum(r.t_round or r.t_draft + r.t_verify for r in self.rounds)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput (prefill excluded)."""
        return self.new_tokens / self.t_decode if self.t_decode > 0 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per round, the correction/bonus token included."""
        return self.new_tokens / self.num_rounds if self.rounds else 0.0

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance rate from per-position counts (accepted / tested).

        Not accepted/drafted: drafts after a rejection are never tested, and counting
        them would bias alpha down.
        """
        reached = sum(self.reached_per_position)
        return sum(self.accepted_per_position) / reached if reached else None

    @property
    def mean_k(self) -> float:
        spec = self.speculative_rounds
        return sum(r.drafted for r in spec) / len(spec) if spec else 0.0

    @property
    def c(self) -> float | None:
        """T_target / T_draft, measured as (mean verification pass) / (mean draft step)."""
        spec = self.speculative_rounds
        steps = sum(r.drafted for r in spec)
        t_draft = sum(r.t_draft for r in spec)
        if not spec or steps == 0 or t_draft <= 0:
            return None
        return (sum(r.t_verify for r in spec) / len(spec)) / (t_draft / steps)

    @property
    def predicted_speedup(self) -> float | None:
        """The documents' E[N] c / (c + K) with the measured alpha, c and (mean) K."""
        if self.alpha is None or self.c is None:
            return None
        k = max(1, round(self.mean_k))
        return speedup(min(self.alpha, 1.0), self.c, k)

    @property
    def tree_rounds(self) -> list[RoundRecord]:
        return [r for r in self.rounds if r.tree_nodes]

    @property
    def mean_tree_nodes(self) -> float:
        """Drafted nodes per tree round (the pass verifies this many plus the pending token)."""
        trees = self.tree_rounds
        return sum(r.tree_nodes for r in trees) / len(trees) if trees else 0.0

    @property
    def off_chain_rounds(self) -> int:
        """Tree rounds won by an alternative branch: tokens a chain alone would have lost."""
        return sum(r.off_chain for r in self.rounds)

    @property
    def k_per_round(self) -> list[int]:
        return [r.drafted for r in self.rounds]

    @property
    def drafter_per_round(self) -> list[str]:
        return [r.drafter for r in self.rounds]

    def summary(self) -> dict:
        return {
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "new_tokens": self.new_tokens, "rounds": self.num_rounds,
            "drafted": self.drafted, "accepted": self.accepted,
            "accepted_per_position": list(self.accepted_per_position),
            "reached_per_position": list(self.reached_per_position),
            "mean_acceptance_length": self.mean_acceptance_length, "alpha": self.alpha, "mean_k": self.mean_k,
            "tokens_per_second": self.tokens_per_second, "t_prefill": self.t_prefill, "t_draft": self.t_draft,
            "t_verify": self.t_verify, "c": self.c, "predicted_speedup": self.predicted_speedup,
            "k_per_round": self.k_per_round, "drafter_per_round": self.drafter_per_round,
            "tree_rounds": len(self.tree_rounds), "mean_tree_nodes": self.mean_tree_nodes,
            "off_chain_rounds": self.off_chain_rounds,
        }

"""Batching: every sequence of a mixed batch is what it is alone, and its law is the target's.

Isolation (float32 tiny models, exact token equality): different prompts and lengths,
fixed K 1..3, adaptive K, lookup/model/no drafters, greedy and seeded sampling, stop
strings, early finishes, more requests than slots (continuous admission) and a request
cancelled mid-way. Sampled rows equal their solo runs because each sequence draws from
its own generator and (fixed K) makes the same draws; greedy rows are K-independent, so
adaptive K may choose differently in a batch and still give the same tokens. The
negative control mixes up the rows of the shared pass and must be caught.

Exactness: the first two tokens of a sequence decoded beside two others (their own
prompts, seeds and K) match the exact joint (chi-square; false-failure probability
1e-3 per case at fixed seeds); a rule that accepts every draft must fail it.
"""

import dataclasses
import functools
import itertools

import pytest
import torch

from specdecode.backends import protocol
from specdecode.core.probs import GREEDY, SamplingParams
from specdecode.core.verify import VerifyResult
from specdecode.drafters.lookup import LookupDrafter
from specdecode.drafters import model as draft_model
from specdecode.drafters.model import ModelDrafter
from specdecode.engine import engine as engine_module, round
from specdecode.engine.config import DEFAULT_PREFILL_TOKENS, GenerationConfig
from specdecode.engine.decoder import SpeculativeDecoder
from specdecode.engine.engine import Engine
from specdecode.engine.request import State
from specdecode.engine.policy import ALONE, AdaptiveK, BatchLoad, _DrafterState
from specdecode.engine.round import run_round
from specdecode.engine.scheduler import SchedulerConfig
from specdecode.engine.slot import Slot, prefill
from tests.engine.test_sampling_exact import PROMPT, V, joint_p_value, pair  # noqa: F401 (a fixture)
from tests.tiny import char_tokenizer, tiny_pair

SAMPLED = SamplingParams(temperature=0.8)
PROMPTS = ["abcabcab", "hello hello", "a", "the cat sat on the mat. the cat", "xyz", "aaaa bbbb aaaa"]
CONFIGS = [GenerationConfig(max_new_tokens=30, sampling=GREEDY, k=3),
           GenerationConfig(max_new_tokens=12, sampling=SAMPLED, k=2, seed=5),
           GenerationConfig(max_new_tokens=25, sampling=GREEDY, k=None),
           GenerationConfig(max_new_tokens=30, sampling=SAMPLED, k=1, seed=9, stop=("}j",)),
           GenerationConfig(max_new_tokens=5, sampling=GREEDY, k=2),
           GenerationConfig(max_new_tokens=20, sampling=SAMPLED, k=3, seed=2)]


@pytest.fixture(scope="module")
def decoder():
    target, draft = tiny_pair(seed=3, noise=0.05, dtype=torch.float32)
    policy = AdaptiveK(k_max=4)
    policy.load_costs({"t_verify": {str(n): 0.01 for n in range(1, 41)}, "t_step": {"lookup": 1e-5, "model": 1e-3}})
    return SpeculativeDecoder(target, char_tokenizer(), [LookupDrafter(), ModelDrafter(draft)], eos_ids=[0],
                              policy=policy, max_batch=4)


def alone(decoder, prompts=PROMPTS, configs=CONFIGS, speculative=True):
    return [decoder.generate(p, c, speculative=speculative) for p, c in zip(prompts, configs)]


def engine(decoder, prefill_tokens=DEFAULT_PREFILL_TOKENS, prompt_cache_bytes=0, patience=4, isolate=False):
    """An engine scheduled as a server's (contexts kept across its requests) over `decoder`'s weights and
    drafters, with caches of its own (its target's siblings): `decoder`, whose runs the tests compare
    with, never touches them, nor they its."""
    return SpeculativeDecoder(decoder.target.sibling(), decoder.tokenizer, [d.fork() for d in decoder.drafters],
                              eos_ids=decoder.eos_ids, policy=decoder.policy, max_batch=decoder.max_batch,
                              scheduling=SchedulerConfig(prefill_tokens, prompt_cache_bytes, patience, isolate,
                                                         persistent=True))


def admit(engine, key, ids, config, speculative=True):
    return engine.add_request(ids, config, key=key, speculative=speculative, text=True)


def step(engine):
    """One round: (request, its new chunks) for each request it advanced."""
    return [(r, r.take()) for r in engine.step()]


def test_batched_sequences_equal_their_solo_runs(decoder):
    solo = alone(decoder)
    batched = decoder.generate_many(PROMPTS, CONFIGS)
    for s, b in zip(solo, batched):
        assert b.tokens == s.tokens and b.text == s.text and b.finish_reason == s.finish_reason
    # the case exercises what it names: drafts of K >= 2 accepted, early ends, a stop string
    assert any(r.drafted >= 2 and r.accepted >= 1 for b in batched for r in b.stats.rounds)
    assert {b.stats.new_tokens for b in batched[:5]} != {30}
    assert batched[3].finish_reason == "stop" and batched[4].stats.new_tokens == 5


def test_plain_and_speculative_rows_mix(decoder):
    plain = alone(decoder, PROMPTS[:3], CONFIGS[:3], speculative=False)
    batched = decoder.generate_many(PROMPTS[:3], CONFIGS[:3], speculative=False)
    assert [b.tokens for b in batched] == [p.tokens for p in plain]
    assert all(r.drafted == 0 for b in batched for r in b.stats.rounds)


def test_a_cancelled_sequence_leaves_the_others_untouched(decoder):
    solo = alone(decoder, PROMPTS[:3], CONFIGS[:3])
    scheduler = engine(decoder)
    active = [admit(scheduler, i, decoder.encode(PROMPTS[i]), CONFIGS[i]) for i in range(3)]
    out = {i: [] for i in range(3)}
    rounds = 0
    while scheduler.scheduler.running:
        for a, chunks in step(scheduler):
            out[a.key] += [t for c in chunks for t in c.tokens]
        rounds += 1
        if rounds == 2:
            scheduler.abort(active[1])  # its client left
            assert len(scheduler.scheduler.free) == 2
    assert out[0] == solo[0].tokens and out[2] == solo[2].tokens
    assert out[1] == solo[1].tokens[:len(out[1])] and len(out[1]) < len(solo[1].tokens)
    assert len(scheduler.scheduler.free) == 4


def test_rows_mixed_up_in_the_pass_are_caught(decoder, monkeypatch):
    """Negative control: the check above must fail when rows see each other's logits."""
    real = protocol.forward_batch
    monkeypatch.setattr(round, "forward_batch", lambda rows: real(rows)[-1:] + real(rows)[:-1] if len(rows) > 1
                        else real(rows))
    solo = alone(decoder, PROMPTS[:3], CONFIGS[:3])
    with pytest.raises((AssertionError, RuntimeError, ValueError, IndexError)):
        batched = decoder.generate_many(PROMPTS[:3], CONFIGS[:3])
        assert [b.tokens for b in batched] == [s.tokens for s in solo]


def test_generate_many_validates(decoder):
    with pytest.raises(ValueError, match="list of prompts"):
        decoder.generate_many("one prompt")
    with pytest.raises(ValueError, match="one config per prompt"):
        decoder.generate_many(["a", "b"], [CONFIGS[0]])
    with pytest.raises(ValueError, match="prompt 1 has"):
        decoder.generate_many(["a", "b" * 300])
    assert decoder.generate_many([]) == []


def test_step_refuses_finished_sequences(decoder):
    scheduler = engine(decoder)
    seq = scheduler.add_request([1, 2, 3], GenerationConfig(max_new_tokens=1))
    scheduler.step()
    assert seq.finished
    with pytest.raises(ValueError, match="finished"):
        run_round([seq])


def test_batch_policy_stops_speculating_when_the_pass_is_full():
    policy = AdaptiveK(k_max=4)
    # a steep curve (each token costs as much as the first: compute-bound), then a flat stretch
    curve = {n: 0.05 * n for n in range(1, 9)} | {16: 0.41, 32: 1.6}
    policy.load_costs({"t_verify": {str(n): t for n, t in curve.items()}, "t_step": {"lookup": 1e-6}})
    policy.drafters["lookup"] = _DrafterState(accepted=60, tested=100)  # alpha ~0.6
    assert policy.choose("lookup", 0, ALONE) == 0  # alpha 0.6 never pays on a steep curve
    # 8 rows of one token cost 0.4 s; a pass of 16 costs about the same: drafting fills it for free
    assert policy.choose("lookup", 0, BatchLoad(8, 8.0)) >= 3
    policy.load_costs({"t_verify": {str(n): 0.01 for n in range(1, 6)} | {"40": 0.4}, "t_step": {"lookup": 1e-6}})
    assert policy.choose("lookup", 0, ALONE) >= 3  # flat alone: draft
    assert policy.choose("lookup", 0, BatchLoad(30, 30.0)) == 0  # a full machine: each token costs as much


def test_a_prompts_piece_does_not_make_drafts_look_free(decoder, monkeypatch):
    """K is chosen against the decoding rows' pass alone: a prompt's piece in the same pass is work
    done whatever K is. Counted in, its hundreds of tokens make every draft look nearly free beside
    the few tokens the pass emits (the load the policy is asked with would include them)."""
    loads = []
    real = AdaptiveK.choose
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, d, lag=0, load=ALONE, situation=None: loads.append(load)
                        or real(self, d, lag, load, situation))
    scheduler = engine(decoder)
    seqs = [scheduler.add_request(decoder.encode(p), CONFIGS[2]) for p in PROMPTS[:2]]  # each its own policy
    other = scheduler.slots[2].target
    prefill(other, [], decoder.encode(PROMPTS[3]), run=False)
    run_round(seqs, [protocol.Row(other, decoder.encode(PROMPTS[3] * 3), 1)])
    assert loads and all(load.tokens <= 1 + 4 + 1 for load in loads)  # the other row (K <= 4), not 93 more


def test_a_shared_round_reports_its_cost_once_per_row_without_prompt_pieces(decoder, monkeypatch):
    """The batch's cost curve is measured on its rounds: each row reports the pass's decoding tokens
    and the round's time; a round carrying a prompt's piece reports nothing (its time is the piece's
    too), nor does a round whose rows feed their prompts' rest (the first), nor a lone row's."""
    reports = []
    monkeypatch.setattr(AdaptiveK, "observe_batch", lambda self, n, t, rows: reports.append((id(self), n, t, rows)))
    scheduler = engine(decoder)
    seqs = [scheduler.add_request(decoder.encode(p), CONFIGS[2]) for p in PROMPTS[:3]]
    assert all(seq.unfed for seq in seqs[:2])  # "a" has no rest
    run_round(seqs)
    assert reports == [] and not any(seq.unfed for seq in seqs)
    run_round(seqs)
    verified = sum(seq.stats.rounds[-1].verified for seq in seqs)
    assert len({r[0] for r in reports}) == 3 and all(r[1:] == reports[0][1:] for r in reports)
    assert reports[0][1] == verified and reports[0][3] == 3 and reports[0][2] > 0
    reports.clear()
    other = scheduler.slots[3].target
    prefill(other, [], decoder.encode(PROMPTS[3]), run=False)
    run_round(seqs, [protocol.Row(other, decoder.encode(PROMPTS[3]), 1)])
    run_round(seqs[:1])
    assert reports == []


def test_lockstep_draft_steps_report_their_cost_by_rows(monkeypatch):
    """Rows drafting with the draft model price each other's steps: a later row's load carries the
    earlier rows' (drafter, K), and every lockstep step's pass is reported, by the rows still in it
    (#{rows with K >= s} at step s), once per drafting row; a lone row reports nothing."""
    target, draft = tiny_pair(seed=3, noise=0.05, dtype=torch.float32)
    policy = AdaptiveK(k_max=4)
    policy.load_costs({"t_verify": {str(n): 0.01 for n in range(1, 41)}, "t_step": {"model": 1e-3}})
    decoder = SpeculativeDecoder(target, char_tokenizer(), [ModelDrafter(draft)], eos_ids=[0], policy=policy,
                                 max_batch=3)
    reports, loads = [], []
    monkeypatch.setattr(AdaptiveK, "observe_draft_batch",
                        lambda self, d, rows, t, reporters: reports.append((id(self), d, rows, t, reporters)))
    real = AdaptiveK.choose
    monkeypatch.setattr(AdaptiveK, "choose", lambda self, d, lag=0, load=ALONE, situation=None: loads.append(load)
                        or real(self, d, lag, load, situation))
    caps = [4, 2, 3]  # each row's k_max, so the rows leave the lockstep at different steps
    seqs = [decoder.add_request(decoder.encode(p), GenerationConfig(max_new_tokens=20, sampling=GREEDY),
                                policy=dataclasses.replace(decoder.policy.for_request(), k_max=cap))
            for p, cap in zip(PROMPTS[:3], caps)]
    loads.clear()
    run_round(seqs)
    ks = [seq.stats.rounds[-1].drafted for seq in seqs]
    assert ks == caps  # every row drafted to its cap: a flat curve and near-free draft steps
    assert [load.lockstep for load in loads] == [(), (("model", 4),), (("model", 4), ("model", 2))]
    steps = [sum(k >= s for k in ks) for s in range(1, max(ks) + 1)]
    assert steps == [3, 3, 2, 1]
    for seq in seqs:
        mine = [r for r in reports if r[0] == id(seq.policy)]
        assert [r[2] for r in mine] == steps and all(r[1] == "model" and r[3] > 0 and r[4] == 3 for r in mine)
    reports.clear()
    run_round(seqs[:1])
    assert reports == []
    for seq in seqs:
        decoder.abort(seq)


def batched_p_value(target, draft, params, rule=None, n=1500) -> float:
    """p-value of the first two tokens of PROMPT decoded as the middle row of a batch of three."""
    slots = [Slot(target, (ModelDrafter(draft),))] + [Slot(target.sibling(), (ModelDrafter(draft.sibling()),))
                                                      for _ in range(2)]
    batch = Engine(slots, frozenset())
    counts = {key: 0 for key in itertools.product(range(V), repeat=2)}
    multi = 0
    for seed in range(n):
        seqs = [batch.add_request([3, 1, 4], GenerationConfig(max_new_tokens=6, sampling=params, k=3,
                                                               seed=10_000 + seed)),
                batch.add_request(PROMPT, GenerationConfig(max_new_tokens=3, sampling=params, k=2, seed=seed),
                                  rule=rule),
                batch.add_request([5, 5], GenerationConfig(max_new_tokens=4, sampling=params, k=1,
                                                           seed=20_000 + seed))]
        assert [seq.slot for seq in seqs] == slots  # the middle row of the pass
        while len(seqs[1].tokens) < 2:
            batch.step()
        for seq in seqs:
            batch.abort(seq)
        counts[tuple(seqs[1].tokens[:2])] += 1
        multi += seqs[1].stats.rounds[0].accepted >= 1
    assert multi >= 0.05 * n  # the second draft's test was reached often enough to matter
    return joint_p_value(target, params, counts)


def test_batched_sequence_has_the_targets_law(pair):
    assert batched_p_value(*pair, SamplingParams(temperature=0.7, top_k=3)) > 1e-3


def test_batched_negative_control_fails(pair):
    generator = torch.Generator().manual_seed(0)

    def accept_all(draft_tokens, q, p, rand) -> VerifyResult:
        k = draft_tokens.shape[1]
        bonus = torch.multinomial(p[:, k], 1, generator=generator).view(-1)
        return VerifyResult.of(draft_tokens, torch.full((1,), k, dtype=torch.long), bonus)
    assert batched_p_value(*pair, SamplingParams(temperature=0.7, top_k=3), rule=accept_all) < 1e-3


def record_passes(monkeypatch) -> list[list[tuple[object, int]]]:
    """Every target pass from now on: (the row's model, its tokens) per row."""
    passes = []
    real = round.forward_batch
    monkeypatch.setattr(round, "forward_batch", lambda rows: passes.append([(r.model, len(r.tokens)) for r in rows])
                        or real(rows))
    return passes


def test_a_long_prompt_runs_in_pieces_beside_the_running_rows(decoder, monkeypatch):
    """Chunked prefill: a pass computes at most prefill_tokens tokens of prompts (less one per running
    row), so a stream that runs advances in every pass while a long prompt arrives, and both decode
    what they decode alone. The old way (the whole prompt in one pass) fails the bound. A request
    that leaves mid-prompt frees its slot for the next, which decodes what it decodes alone."""
    passes = record_passes(monkeypatch)
    bound = 10
    scheduler = engine(decoder, prefill_tokens=bound)
    short, long_ = PROMPTS[1], PROMPTS[3] + " " + PROMPTS[5] + " " + PROMPTS[3]
    out: dict[str, list[int]] = {}

    def run_step():
        for a, chunks in step(scheduler):
            out.setdefault(a.key, []).extend(t for c in chunks for t in c.tokens)

    first = admit(scheduler, "a", decoder.encode(short), CONFIGS[0], speculative=False)
    run_step()
    assert scheduler.can_admit()  # a free slot is all it takes: the prompt waits its turn in pieces
    second = admit(scheduler, "b", decoder.encode(long_), CONFIGS[4], speculative=False)
    n_prompt = len(decoder.encode(long_)) - 1  # the last token is the first round's `pending`
    assert n_prompt > 3 * bound
    n_before = len(passes)
    while not second.tokens:
        assert second.state is State.PREFILLING
        run_step()
    prompt_passes = passes[n_before:]  # the last: its last piece and first token's step, in one row
    pieces = [n for pass_ in prompt_passes for model, n in pass_ if model is second.slot.target]
    assert sum(pieces) == n_prompt + 1 and len(pieces) >= 4
    for pass_ in prompt_passes:  # the running row in every pass, the prompt's piece within the bound
        assert (first.slot.target, 1) in pass_
        assert sum(n for model, n in pass_ if model is second.slot.target) <= bound - 1
    while scheduler.scheduler.running:
        run_step()
    assert out["a"] == decoder.generate(short, CONFIGS[0], speculative=False).tokens
    assert out["b"] == decoder.generate(long_, CONFIGS[4], speculative=False).tokens

    # a client that leaves mid-prompt: its slot is free at once and keeps the start of the prompt
    # that ran (a later prompt that starts the same way reuses it)
    for key in "cdef":  # prompts no slot holds the start of (else the prefix cache skips their prefill)
        admit(scheduler, key, decoder.encode(key + long_), CONFIGS[4])
    assert not scheduler.can_admit()
    run_step()  # "c"'s first piece
    leaving = scheduler.scheduler.running[0]
    held = leaving.slot.target.length
    assert 0 < held < len(leaving.prompt) - 1 and not leaving.tokens
    scheduler.abort(leaving)
    assert scheduler.can_admit() and scheduler.scheduler.held[id(leaving.slot)] == leaving.prompt[:held]
    late = admit(scheduler, "g", decoder.encode(short), CONFIGS[1])
    assert late.slot is leaving.slot
    while scheduler.scheduler.running:
        run_step()
    assert out["g"] == decoder.generate(short, CONFIGS[1]).tokens
    assert all(out[key] == decoder.generate(key + long_, CONFIGS[4]).tokens for key in "def")


def test_the_shortest_prompt_goes_first_and_a_passed_over_one_is_not_starved(decoder, monkeypatch):
    """A short prompt admitted behind a long one runs first (its request decodes while the long prompt
    is still in pieces); with patience 1, the long prompt passed over once goes before the shorter
    ones; with a large patience it waits for them (the control). Every output is the one alone."""
    long_ = PROMPTS[3] + " " + PROMPTS[5] + " " + PROMPTS[3]
    shorts = ["hello hello hi", "abcabcabcab", "aaaa bbbb aa"]  # 10-13 prompt tokens each
    bound = 10

    def first_pieces(patience: int) -> tuple[list[list[tuple[str, int]]], dict[str, list[int]]]:
        passes = record_passes(monkeypatch)
        scheduler = engine(decoder, prefill_tokens=bound, patience=patience)
        owner = {}
        for key, prompt in [("long", long_)] + [(f"s{i}", p) for i, p in enumerate(shorts)]:
            owner[id(admit(scheduler, key, decoder.encode(prompt), CONFIGS[4], speculative=False).slot.target)] = key
        out: dict[str, list[int]] = {}
        while scheduler.scheduler.running:
            for a, chunks in step(scheduler):
                out.setdefault(a.key, []).extend(t for c in chunks for t in c.tokens)
        return [[(owner[id(model)], n) for model, n in pass_] for pass_ in passes[:5]], out

    eager, out = first_pieces(patience=100)
    prompt_rows = [[key for key, n in pass_ if n > 1] for pass_ in eager]  # a piece, or a prompt's rest and step
    # s1's 10 tokens fill the first pass (10 + its first step would not fit: it decodes from the next); s2 and s0
    # end beside their first token's step; the long prompt waits for the three
    assert prompt_rows == [["s1"], ["s2"], ["s0", "s2"], ["s0"], ["long"]]
    patient, out_patient = first_pieces(patience=1)
    assert patient[0] == [("s1", 10)] and patient[1] == [("long", 9), ("s1", 1)]  # passed over once: it goes first
    for key, prompt in [("long", long_)] + [(f"s{i}", p) for i, p in enumerate(shorts)]:
        alone = decoder.generate(prompt, CONFIGS[4], speculative=False).tokens
        assert out[key] == out_patient[key] == alone, key


def record_kept(monkeypatch) -> list[int]:
    """The `keep` (cached prompt tokens) of every prefill from now on."""
    kept = []
    real = engine_module.prefill
    monkeypatch.setattr(engine_module, "prefill", lambda *a, **kw: kept.append(a[3] if len(a) > 3 else kw.get("keep", 0))
                        or real(*a, **kw))
    return kept


def run_alone_in(decoder, scheduler, prompt, config):
    """Admit one request and step the scheduler until it ends: (its Active, its tokens)."""
    active = admit(scheduler, prompt, decoder.encode(prompt), config)
    out = []
    while active in scheduler.scheduler.running:
        out += [t for a, chunks in step(scheduler) if a is active for c in chunks for t in c.tokens]
    return active, out


def test_a_freed_slot_keeps_its_context_for_a_prompt_that_starts_the_same(decoder, monkeypatch):
    """The prefix cache: a prompt that repeats a finished request's context (a chat's next turn)
    skips that much prefill and decodes what it decodes alone, and a different prompt reuses nothing.
    A library call (an engine that is not persistent) never starts from what an earlier call left:
    another decoder may have used the models in between."""
    kept = record_kept(monkeypatch)

    def run(scheduler, prompt, config):
        return run_alone_in(decoder, scheduler, prompt, config)[1]

    scheduler = engine(decoder)
    first = run(scheduler, PROMPTS[3], CONFIGS[0])
    follow_up = PROMPTS[3] + decoder.tokenizer.decode(first) + " and the dog"
    second = run(scheduler, follow_up, CONFIGS[1])
    n_first = len(decoder.encode(PROMPTS[3]))
    assert kept[-1] >= n_first  # the first prompt and its output came from the cache
    assert second == decoder.generate(follow_up, CONFIGS[1]).tokens  # ... and decode what they decode alone
    # the same prompt again: all of it (but `pending`) from the cache, the same output
    kept.clear()
    assert run(scheduler, follow_up, CONFIGS[1]) == second
    assert kept == [len(decoder.encode(follow_up)) - 1]
    # a library call keeps nothing for the next one
    kept.clear()
    assert decoder.generate(follow_up, CONFIGS[1]).tokens == second
    assert kept == [0]
    # and a different prompt reuses nothing
    kept.clear()
    run(scheduler, "zzz" + PROMPTS[3], CONFIGS[0])
    assert kept == [0]


def test_the_prompt_cache_restores_a_context_a_slot_no_longer_holds(decoder, monkeypatch):
    """With a prompt cache in host memory, a context overwritten in its slot (every slot took other
    prompts since) is restored for a follow-up that starts with it, which then decodes exactly what
    it decodes alone. Without the cache (the control) the same follow-up recomputes its prompt, and
    so it does, with the same output, when the backend cannot restore (no room in its cache)."""
    kept = record_kept(monkeypatch)
    run = functools.partial(run_alone_in, decoder)

    def no_room(self, snapshot):
        raise RuntimeError("no room")

    for cache_bytes, restored in ((10 ** 9, True), (0, False), (10 ** 9, False)):
        if cache_bytes and not restored:
            monkeypatch.setattr(type(decoder.target), "restore", no_room)
        scheduler = engine(decoder, prompt_cache_bytes=cache_bytes)
        _, first = run(scheduler, PROMPTS[3], CONFIGS[0])
        for i, other in enumerate(PROMPTS[:3] + PROMPTS[4:5]):  # the fourth overwrites the first one's slot
            run(scheduler, f"{i}{other}", CONFIGS[4])
        follow_up = PROMPTS[3] + decoder.tokenizer.decode(first) + " and the dog"
        kept.clear()
        active, second = run(scheduler, follow_up, CONFIGS[1])
        n_first = len(decoder.encode(PROMPTS[3]))
        assert (kept[-1] >= n_first) is restored, (cache_bytes, kept)
        assert active.stats.cached_tokens == kept[-1]
        assert second == decoder.generate(follow_up, CONFIGS[1]).tokens
    assert len(decoder.slots) == 4  # four other prompts did overwrite every slot


def test_with_a_prompt_cache_a_finished_context_leaves_the_shared_pool(decoder, monkeypatch):
    """In one KV pool (llama.cpp's) attention spans every slot's cells, so idle contexts slow the
    running rows (5-6% for a lone stream, measured). With a prompt cache a finished request's context
    moves to host memory: its slot's target holds nothing, and a follow-up is restored from the cache
    (its prompt's cells not computed again) and decodes what it decodes alone. Without one (the
    control) the slot keeps the context in place."""
    kept = record_kept(monkeypatch)
    run = functools.partial(run_alone_in, decoder)
    for cache_bytes in (10 ** 9, 0):
        scheduler = engine(decoder, prompt_cache_bytes=cache_bytes)
        active, first = run(scheduler, PROMPTS[3], CONFIGS[0])
        assert (active.slot.target.length == 0) is bool(cache_bytes)
        follow_up = PROMPTS[3] + decoder.tokenizer.decode(first) + " and the dog"
        kept.clear()
        active, second = run(scheduler, follow_up, CONFIGS[1])
        assert kept[-1] >= len(decoder.encode(PROMPTS[3])) and active.stats.cached_tokens == kept[-1]
        assert second == decoder.generate(follow_up, CONFIGS[1]).tokens
        assert (len(scheduler.scheduler.prompt_cache or ()) > 0) is bool(cache_bytes)


def test_a_new_prompt_runs_in_the_running_rows_pass(decoder, monkeypatch):
    """A request admitted while another decodes has its prompt computed in the same pass as the
    running row (which advances meanwhile: no pass of its own for the prompt), takes its first token
    from that pass, and both produce what they produce alone. The scheduler reports the whole pass's
    size, the prompt's row included."""
    passes = record_passes(monkeypatch)
    scheduler = engine(decoder)
    out = {}
    first = admit(scheduler, "a", decoder.encode(PROMPTS[1]), CONFIGS[0], speculative=False)
    for _ in range(3):
        for a, chunks in step(scheduler):
            out.setdefault(a.key, []).extend(t for c in chunks for t in c.tokens)
    long_prompt = decoder.encode(PROMPTS[3])
    second = admit(scheduler, "b", long_prompt, CONFIGS[4], speculative=False)
    n_before, sizes = len(passes), []
    while scheduler.scheduler.running:
        for a, chunks in step(scheduler):
            out.setdefault(a.key, []).extend(t for c in chunks for t in c.tokens)
        sizes.append(scheduler.pass_tokens)
    shared = passes[n_before]  # the first pass after the admission
    assert sizes == [sum(n for _, n in pass_) for pass_ in passes[n_before:]]  # what /metrics observes
    assert (second.slot.target, len(long_prompt)) in shared  # the prompt, `pending` its last token
    assert (first.slot.target, 1) in shared  # beside the running row
    assert second.stats.rounds[0].verified == 1  # its first round: the prompt's rest is not verified
    assert second.stats.t_prefill > 0 and second.stats.cached_tokens == 0
    assert out["a"] == decoder.generate(PROMPTS[1], CONFIGS[0], speculative=False).tokens
    assert out["b"] == decoder.generate(PROMPTS[3], CONFIGS[4], speculative=False).tokens


@pytest.fixture(scope="module")
def model_only():
    """The draft model as the only drafter, K fixed: every row drafts each round."""
    target, draft = tiny_pair(seed=3, noise=0.05, dtype=torch.float32)
    return SpeculativeDecoder(target, char_tokenizer(), [ModelDrafter(draft)], eos_ids=[0], max_batch=4)


MODEL_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[5]]  # each long enough for a catch-up pass
MODEL_CONFIGS = [GenerationConfig(max_new_tokens=20, sampling=GREEDY, k=3),
                 GenerationConfig(max_new_tokens=14, sampling=SAMPLED, k=2, seed=5),
                 GenerationConfig(max_new_tokens=9, sampling=GREEDY, k=1),
                 GenerationConfig(max_new_tokens=16, sampling=SAMPLED, k=3, seed=2)]


def draft_passes(monkeypatch) -> list[list[int]]:
    """Record every pass of the draft model's lockstep drafting: the length of each row."""
    passes, real = [], draft_model.forward_batch
    monkeypatch.setattr(draft_model, "forward_batch",
                        lambda rows: passes.append([len(r.tokens) for r in rows]) or real(rows))
    return passes


def test_draft_steps_run_together_and_each_row_leaves_at_its_own_k(model_only, monkeypatch):
    """Four rows drafting K = 3, 2, 1, 3 take 3 draft passes a round (after the first round's
    catch-up), not 9, each step carrying the rows still drafting; and each row's tokens are
    its solo run's (sampled rows draw their drafts from their own generators)."""
    solo = alone(model_only, MODEL_PROMPTS, MODEL_CONFIGS)
    passes = draft_passes(monkeypatch)
    scheduler = engine(model_only)
    active = [admit(scheduler, i, model_only.encode(MODEL_PROMPTS[i]), MODEL_CONFIGS[i]) for i in range(4)]
    step(scheduler)  # the prompts ride in the rows of the first round (the draft catches up on them first)
    passes.clear()
    step(scheduler)  # every row drafts: K steps in lockstep
    assert [len(p) for p in passes] == [4, 3, 2]  # step 1 (all), 2 (K >= 2), 3 (K = 3)
    assert all(n <= 2 for p in passes for n in p)  # a draft step feeds one or two tokens (a catch-up's too)
    assert [a.stats.rounds[-1].drafted for a in active] == [3, 2, 1, 3]
    out = {i: list(a.tokens) for i, a in enumerate(active)}
    while scheduler.scheduler.running:
        for a, chunks in step(scheduler):
            out[a.key] += [t for c in chunks for t in c.tokens]
    assert [out[i] for i in range(4)] == [s.tokens for s in solo]


def test_draft_rows_mixed_up_in_lockstep_are_caught(model_only, monkeypatch):
    """Negative control: rows of the draft model's batched step seeing each other's logits."""
    real = protocol.forward_batch
    monkeypatch.setattr(draft_model, "forward_batch", lambda rows: real(rows)[-1:] + real(rows)[:-1] if len(rows) > 1
                        else real(rows))
    solo = alone(model_only, MODEL_PROMPTS, MODEL_CONFIGS)
    with pytest.raises((AssertionError, RuntimeError, ValueError, IndexError)):
        batched = model_only.generate_many(MODEL_PROMPTS, MODEL_CONFIGS)
        assert [b.tokens for b in batched] == [s.tokens for s in solo]



POISON = "!"  # a request whose prompt holds it fails (the tests' injected fault)
MARK = "\x01never"  # the poisoned request's stop string: how a TextAssembler knows it is the poisoned one


def inject(monkeypatch, where: str) -> list[int]:
    """Make the poisoned request's rounds fail `where`: in the target pass (as a kernel error
    would: any pass with its row fails), in its drafting, or in turning its tokens into text.
    Returns a list that grows by one at every injected failure."""
    poison, failed = char_tokenizer().convert_tokens_to_ids(POISON), []
    if where == "pass":
        real_pass = round.forward_batch

        def forward(rows):
            if any(poison in row.tokens for row in rows):
                failed.append(len(rows))
                raise RuntimeError("llama_decode failed with code -1")
            return real_pass(rows)
        monkeypatch.setattr(round, "forward_batch", forward)
    elif where == "drafting":
        real_draft = LookupDrafter.continuation

        def continuation(self, context, path, k):
            if poison in context:
                failed.append(1)
                raise ValueError("a drafter bug")
            return real_draft(self, context, path, k)
        monkeypatch.setattr(LookupDrafter, "continuation", continuation)
    else:
        from specdecode.engine.text import TextAssembler
        real_add = TextAssembler.add

        def add(self, tokens, sources):
            if MARK in self.stop:
                failed.append(1)
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a detokenizer bug")
            return real_add(self, tokens, sources)
        monkeypatch.setattr(TextAssembler, "add", add)
    return failed


def run_all(scheduler, decoder, prompts, configs):
    """Admit every prompt as slots free and run to the end: (tokens by key, error by key)."""
    waiting, out, errors = list(range(len(prompts))), {}, {}
    while waiting or scheduler.scheduler.running:
        while waiting and scheduler.can_admit():
            i = waiting.pop(0)
            admit(scheduler, i, decoder.encode(prompts[i]), configs[i])
        for a, chunks in step(scheduler):
            out.setdefault(a.key, []).extend(t for c in chunks for t in c.tokens)
            if a.error is not None:
                assert not chunks and a.key not in errors and a not in scheduler.scheduler.running
                errors[a.key] = a.error
    return out, errors


@pytest.mark.parametrize("where", ["pass", "drafting", "text"])
def test_a_failing_request_ends_alone_and_its_neighbours_are_untouched(decoder, monkeypatch, where):
    """A request whose round fails (in the shared target pass, in its drafting, or in turning its
    tokens into text) ends with its error; every request batched beside it (5 requests for 4 slots:
    one is admitted into the freed slot), seeded sampled ones included (fixed K: the same draws as
    alone, the failed round's draws put back), produces exactly what it produces alone, and every
    slot is free at the end. Before, the whole batch ended with the error."""
    prompts = [PROMPTS[0], "abc" + POISON + "abc", PROMPTS[3], PROMPTS[1], PROMPTS[5]]
    configs = [CONFIGS[0], dataclasses.replace(CONFIGS[0], stop=(MARK,)), CONFIGS[1], CONFIGS[3], CONFIGS[5]]
    healthy = [0, 2, 3, 4]
    solo = alone(decoder, [prompts[i] for i in healthy], [configs[i] for i in healthy])
    failed = inject(monkeypatch, where)
    scheduler = engine(decoder, isolate=True)
    out, errors = run_all(scheduler, decoder, prompts, configs)
    assert failed, "the fault was never injected: the test tests nothing"
    if where == "pass":
        assert max(failed) > 1, "the failing pass was never a shared one"
    assert list(errors) == [1] and type(errors[1]).__name__ in {"RuntimeError", "ValueError", "UnicodeDecodeError"}
    assert [out[i] for i in healthy] == [s.tokens for s in solo]
    assert any(r.drafted >= 2 for s in solo for r in s.stats.rounds)  # the neighbours drafted
    assert len(scheduler.scheduler.free) == decoder.max_batch and not scheduler.scheduler.running
    assert scheduler.isolated >= (1 if where == "pass" else 0)


def test_without_isolation_a_failure_ends_the_batch(decoder, monkeypatch):
    """The library's batch (no `isolate`): the error is raised, every request released."""
    inject(monkeypatch, "pass")
    scheduler = engine(decoder)
    for i, prompt in enumerate([PROMPTS[0], "ab" + POISON]):
        admit(scheduler, i, decoder.encode(prompt), CONFIGS[0])
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        scheduler.step()
    assert not scheduler.scheduler.running and len(scheduler.scheduler.free) == decoder.max_batch
    assert scheduler.isolated == 0


def test_a_failing_prompt_piece_ends_its_request_alone(decoder, monkeypatch):
    """Chunked prefill: a poisoned prompt that runs in pieces beside a decoding row fails alone; the
    row beside it decodes what it decodes alone."""
    failed = inject(monkeypatch, "pass")
    scheduler = engine(decoder, prefill_tokens=4, isolate=True)
    prompts = [PROMPTS[3], "abcabcabc" + POISON]
    out, errors = run_all(scheduler, decoder, prompts, CONFIGS[:2])
    assert failed and max(failed) > 1
    assert list(errors) == [1] and out[0] == decoder.generate(prompts[0], CONFIGS[0]).tokens
    assert len(scheduler.scheduler.free) == decoder.max_batch


def test_an_interrupt_in_a_round_ends_every_request(decoder, monkeypatch):
    """Ctrl-C is not a request's failure: it ends the batch and is raised (no row is rerun)."""
    calls = []

    def interrupted(rows):
        calls.append(len(rows))
        raise KeyboardInterrupt
    monkeypatch.setattr(round, "forward_batch", interrupted)
    scheduler = engine(decoder, isolate=True)
    for i in range(3):
        admit(scheduler, i, decoder.encode(PROMPTS[i]), CONFIGS[0])
    with pytest.raises(KeyboardInterrupt):
        scheduler.step()
    assert calls == [3] and not scheduler.scheduler.running and len(scheduler.scheduler.free) == decoder.max_batch


def test_generate_many_raises_a_prompts_error(decoder, monkeypatch):
    inject(monkeypatch, "pass")
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        decoder.generate_many([PROMPTS[0], "ab" + POISON], CONFIGS[:2])

"""`specdecode theory`, `specdecode simulate`, `specdecode rand7`: the mathematics, runnable."""

from __future__ import annotations

import argparse

import numpy as np
import torch

from specdecode.cli.generate import positive_finite, seed_int
from specdecode.cli.output import console, emit_json, table
from specdecode.core.classic import (UniformSource, expected_calls_basic, expected_calls_recycling, rand7_basic,
                                     rand7_recycling)
from specdecode.core.simulate import random_pair, simulate_rounds
from specdecode.core.theory import acceptance_rate, break_even_alpha, expected_tokens, optimal_k, speedup
from specdecode.stats import chi_square


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("theory", help="E[N] / speedup table, optimal K and break-even alpha",
                       description="Tabulate E[N] = (1-alpha^(K+1))/(1-alpha) and speedup E[N] c/(c+K).")
    p.add_argument("--alpha", type=float, nargs="+", default=None,
                   help="acceptance rate(s) in [0, 1] (default: 0.5 .. 0.9; not with --p/--q, which give alpha)")
    p.add_argument("--c", type=positive_finite, default=10.0, help="c = T_target / T_draft (default 10)")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 8],
                   help="draft lengths K, 1..64 (default 1 2 3 4 5 6 7 8)")
    p.add_argument("--p", type=_floats,
                   help="target distribution, e.g. 0.7,0.3 (with --q: alpha from the pair; default: none)")
    p.add_argument("--q", type=_floats, help="draft distribution, e.g. 0.4,0.6 (default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    p.set_defaults(func=run_theory)

    s = sub.add_parser("simulate", help="Monte Carlo rounds vs the formulas (exercise 6)",
                       description="Simulate speculative rounds over a random (p, q) pair with the real rule.")
    s.add_argument("--vocab", type=int, default=100, help="vocabulary size, 2..262144 (default 100)")
    s.add_argument("--k", type=int, default=4, help="draft length K, 1..64 (default 4)")
    s.add_argument("--rounds", type=int, default=10_000, help="number of rounds (default 10000)")
    s.add_argument("--closeness", type=float, default=0.8,
                   help="how close the random q is to p: 0 = independent, 1 = equal (default 0.8)")
    s.add_argument("--seed", type=seed_int, default=0,
                   help="seed of the random pair and rounds, 0 to 2**63 - 1 (default 0)")
    s.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    s.set_defaults(func=run_simulate)

    r = sub.add_parser("rand7", help="rand7 from rand5 by rejection sampling, with measured call counts",
                       description="The classic analogy: rejection sampling with and without recycling.")
    r.add_argument("--n", type=int, default=100_000, help="number of rand7 draws (default 100000)")
    r.add_argument("--seed", type=seed_int, default=0, help="seed of the rand5 source, 0 to 2**63 - 1 (default 0)")
    r.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    r.set_defaults(func=run_rand7)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


DEFAULT_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
K_MAX = 64  # speedup() uses CostModel.flat, whose cost curve covers K <= 64
VOCAB_MAX = 262_144  # the largest vocabularies in use (Gemma 3: 262,144 tokens)
# simulate: rounds x (K+1) x V probabilities verified, ~10 ns each on one CPU core, so at most
# about 90 s (the defaults at Qwen's 151,936 tokens take about 80 s); beyond it, say so instead of hanging
WORK_MAX = 2**33
# rand7: both methods draw --n times in Python, ~2.5 us a draw together, so at most about 30 s
RAND7_MAX = 10**7


def run_theory(args: argparse.Namespace) -> int:
    alphas = list(dict.fromkeys(args.alpha or DEFAULT_ALPHAS))  # one row per alpha, as per K, in order
    pair_alpha = None
    if (args.p is None) != (args.q is None):
        raise ValueError("--p and --q go together: give both distributions to compute alpha")
    if args.p is not None and args.alpha is not None:
        raise ValueError("--alpha and --p/--q both set alpha: give one or the other")
    if args.p is not None:
        p = torch.tensor(args.p, dtype=torch.float64)
        q = torch.tensor(args.q, dtype=torch.float64)
        pair_alpha = acceptance_rate(p, q)
        alphas = [pair_alpha]
    ks = sorted(set(args.k))
    bad = [k for k in ks if not 1 <= k <= K_MAX]
    if bad:
        raise ValueError(f"--k values must be 1..{K_MAX} (the speedup model's cost curve covers K <= {K_MAX}), "
                         f"got {bad[0]}")
    rows = [{"alpha": a, "K": k, "E[N]": expected_tokens(a, k), "speedup": speedup(a, args.c, k)}
            for a in alphas for k in ks]
    best = {a: optimal_k(a, args.c, k_max=max(ks)) for a in alphas}
    breakeven = {k: break_even_alpha(k, args.c) for k in ks}
    if args.json:
        emit_json({"c": args.c, "pair_alpha": pair_alpha, "rows": rows,
                   "optimal_k": {str(a): k for a, k in best.items()},
                   "break_even_alpha": {str(k): v for k, v in breakeven.items()}})
        return 0
    if pair_alpha is not None:
        console.print(f"alpha = sum min(p, q) = 1 - TV(p, q) = [bold]{pair_alpha:.4f}[/]")
    console.print(table(f"E[N] and speedup E[N]*c/(c+K), c = {args.c:g}",
                        ["alpha", "K", "E[N]", "speedup"],
                        [[r["alpha"], r["K"], r["E[N]"], f"{r['speedup']:.2f}x"] for r in rows]))
    console.print(table("optimal K (0 = do not speculate)", ["alpha", "K*", "speedup"],
                        [[a, k, f"{speedup(a, args.c, k) if k else 1.0:.2f}x"] for a, k in best.items()]))
    console.print(table(f"break-even alpha (speedup = 1) at c = {args.c:g}", ["K", "alpha"],
                        [[k, "none: never pays (c < 1)" if v is None else v] for k, v in breakeven.items()]))
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    # bounds first: the simulator's time grows with rounds x K x V, and its memory with K
    if not 2 <= args.vocab <= VOCAB_MAX:
        raise ValueError(f"--vocab must be 2..{VOCAB_MAX}, got {args.vocab}")
    if not 1 <= args.k <= K_MAX:
        raise ValueError(f"--k must be 1..{K_MAX} (as in `specdecode theory`), got {args.k}")
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    per_round = (args.k + 1) * args.vocab
    if args.rounds * per_round > WORK_MAX:
        raise ValueError(f"--rounds {args.rounds} at --k {args.k} and --vocab {args.vocab} would verify "
                         f"{args.rounds * per_round:.2g} probabilities (minutes of CPU): give --rounds "
                         f"{WORK_MAX // per_round} or fewer, or a smaller --k or --vocab")
    if not 0 <= args.closeness <= 1:
        raise ValueError("--closeness must be in [0, 1]")
    g = torch.Generator().manual_seed(args.seed)
    p, q = random_pair(args.vocab, g, closeness=args.closeness)
    res = simulate_rounds(p, q, args.k, args.rounds, g)
    fit_n = chi_square(res.n_counts, res.n_pmf)
    fit_tokens = chi_square(res.token_counts, res.p)
    if args.json:
        emit_json({"k": res.k, "rounds": res.rounds, "alpha": res.alpha, "expected_tokens": res.expected_tokens,
                   "mean_tokens": res.mean_tokens, "n_counts": res.n_counts, "n_pmf": res.n_pmf,
                   "n_p_value": fit_n.p_value, "token_p_value": fit_tokens.p_value})
        return 0
    console.print(f"vocab {args.vocab}, K = {res.k}, {res.rounds} rounds, alpha = {res.alpha:.4f}")
    console.print(f"tokens per round: measured [bold]{res.mean_tokens:.4f}[/], "
                  f"formula (1-a^(K+1))/(1-a) = [bold]{res.expected_tokens:.4f}[/]")
    console.print(table("tokens emitted per round", ["N", "measured", "P(N) formula"],
                        [[i + 1, c / res.rounds, pr] for i, (c, pr) in enumerate(zip(res.n_counts, res.n_pmf))]))
    console.print(f"N distribution vs formula: chi-square p-value {shown(fit_n.p_value, '--rounds')}")
    console.print(f"emitted tokens vs target p ({fit_tokens.samples} tokens, {fit_tokens.categories} cells): "
                  f"chi-square p-value {shown(fit_tokens.p_value, '--rounds')}")
    return 0


def shown(p: float | None, more: str) -> str:
    return f"{p:.3f}" if p is not None else f"none: too few samples for the test (raise {more})"


def run_rand7(args: argparse.Namespace) -> int:
    if not 1 <= args.n <= RAND7_MAX:
        raise ValueError(f"--n must be 1..{RAND7_MAX} (more would run for minutes), got {args.n}")
    rows = []
    for name, fn, exact in [("basic", rand7_basic, expected_calls_basic()),
                            ("recycling", rand7_recycling, expected_calls_recycling())]:
        src = UniformSource(5, np.random.default_rng(args.seed))
        tally = [0] * 8  # counted as drawn: no list of --n results in memory
        for _ in range(args.n):
            tally[fn(src)] += 1
        counts = np.array(tally[1:])
        fit = chi_square(counts.tolist(), [1 / 7] * 7)
        rows.append({"method": name, "calls_per_draw": src.calls / args.n, "exact": float(exact),
                     "exact_fraction": str(exact), "uniformity_p_value": fit.p_value,
                     "frequencies": (counts / args.n).tolist()})
    if args.json:
        emit_json({"n": args.n, "methods": rows})
        return 0
    console.print(table(f"rand7 from rand5, {args.n} draws", ["method", "rand5 calls/draw", "exact", "uniformity p"],
                        [[r["method"], r["calls_per_draw"], f"{r['exact']:.4f} ({r['exact_fraction']})",
                          shown(r["uniformity_p_value"], "--n")] for r in rows]))
    console.print("Recycling reuses the rejected remainder, as speculative decoding resamples from the "
                  "residual max(0, p - q) instead of discarding the target's forward pass.")
    return 0

"""Plain-text tables of the reports the core computes (tabulate). Formatting only."""

from __future__ import annotations

from tabulate import tabulate


def _f(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def replay_tables(r: dict) -> str:
    """``adaspark replay``'s report: Table 2, Figure 10 and Table 7 quantities."""
    a, cal, ng = r["acceptance"], r["calibration"], r["ngram"]
    out = []
    rows = [[q["request"], q["rounds"], q["nodes"], _f(q["head_loss"]), _f(q["fitted_loss"]), _pct(q["change"]),
             f'{q["fitted_rounds"]}/{q["tree_rounds"]}', q["finish"] or "-"] for q in a["requests"]]
    head = ["request", "rounds", "nodes", "head-based", "fitted", "change", "fitted priced", "finish"]
    if any(q["sampled"] for q in a["requests"]):  # a mixed log: which regime each request taught
        rows = [[*row, "sampled" if q["sampled"] else "greedy"] for row, q in zip(rows, a["requests"])]
        head.append("regime")
    out.append("Acceptance prediction per request: log loss per labelled node, scored before learning (Table 2, Figure 4)")
    out.append(tabulate(rows, head, disable_numparse=True))
    first = a["first_request"]
    summary = [
        ["requests scored (after the first, not capped)", a["scored_requests"]],
        ["labelled nodes", a["nodes"]],
        ["log loss, head-based", _f(a["head_loss"])],
        ["log loss, fitted", _f(a["fitted_loss"])],
        ["requests won by the fitted model", f'{a["requests_won"]}/{a["scored_requests"]}'],
        ["rounds priced by the fitted model", _pct(a["priced_share"])],
        ["first request: fitted-priced / tree rounds", f'{first["fitted_rounds"]}/{first["tree_rounds"]}' if first else "-"],
    ]
    out.append("\n" + tabulate(summary, tablefmt="plain", disable_numparse=True))
    out.append(f"\nCalibration over {cal['rounds']} rounds whose width the chooser set from S (Figure 10): "
               f"accepted / expected = {_f(cal['ratio'], '.3f')} ({cal['accepted']} / {cal['expected']:.1f})")
    if cal["bins"]:
        out.append(tabulate([[i + 1, b["rounds"], _f(b["mean_expected"], ".3f"), _f(b["mean_accepted"], ".3f"),
                              _f(b["ratio"], ".3f")] for i, b in enumerate(cal["bins"])],
                            ["bin of S", "rounds", "mean S", "mean accepted", "ratio"], disable_numparse=True))
    rate = ng["acceptance_rate"]
    out.append("\nWhat the n-gram fill adds (Table 7)")
    out.append(tabulate([
        ["verified rows held by n-gram-only nodes", _pct(ng["rows_share_ngram"])],
        ["accepted draft tokens from n-gram-only nodes", _pct(ng["accepted_share_ngram"])],
        ["accepted draft tokens from nodes both sources proposed", _pct(ng["accepted_share_both"])],
        ["acceptance rate, drafter-only nodes", _pct(rate["drafter"])],
        ["acceptance rate, nodes both proposed", _pct(rate["both"])],
        ["acceptance rate, n-gram-only nodes", _pct(rate["ngram"])],
        ["verified rows held by n-gram memory nodes", _pct(ng["rows_share_memory"])],
        ["accepted draft tokens from n-gram memory nodes", _pct(ng["accepted_share_memory"])],
        ["acceptance rate, n-gram memory nodes", _pct(rate["memory"])],
        ["rounds with n-gram candidates", ng["rounds_with_ngram"]],
        ["of those, rounds the n-gram widened the verify", _pct(ng["widened_share"])],
    ], tablefmt="plain", disable_numparse=True))
    if r.get("batched"):  # requests decoded together (serve --parallel): widths by load
        out.append("\nRounds verified together, by requests in their step")
        out.append(tabulate([[n, b["rounds"], _f(b["mean_width"], ".2f"),
                              " ".join(f"{w}:{k}" for w, k in b["widths"].items())] for n, b in r["batched"].items()],
                            ["requests", "rounds", "mean width", "widths (rows:rounds)"], disable_numparse=True))
    if r.get("step_times"):  # where a batched step's time goes, by load (steps without prompt tokens)
        out.append("\nTime per batched step (ms), by requests in the step")
        out.append(tabulate([[n, t["steps"], t["prefill_steps"], *(_f(ms, ".2f") for ms in t["ms"].values()),
                              _pct(t["host_share"])] for n, t in r["step_times"].items()],
                            ["requests", "steps", "with prompt", "llama_decode", "propose+decide", "batch build+argmax",
                             "commit", "learn", "host share"], disable_numparse=True))
    return "\n".join(out) + "\n"


_CAUSES = [("cold_start", "cold start (measuring rounds)"), ("exploration", "exploration"),
           ("holding", "holding (hysteresis margin)"), ("acceptance", "acceptance mispricing"),
           ("cost", "cost mispricing"), ("adaptivity", "adaptivity (per-round choice, a gain)")]


def regret_tables(accounts: list[dict]) -> str:
    """``adaspark replay --regret``: one hindsight account per arm of the log."""
    out = []
    for a in accounts:
        out.append(f"\nHindsight account of {a['arm']}{', sampled rounds' if a['sampled'] else ''}: {a['rounds']} rounds, {a['tokens']} tokens, "
                   f"{a['wall_ms'] / 1e3:.2f} s (verify {a['verify_ms'] / 1e3:.2f} s)")
        if a["best_width"] is None:
            out.append("no width has 3 measured verifies in the logs given: nothing to price (add --costs)")
            continue
        rates = [
            ["realised (measured wall time)", _f(a["realised_rate"], ".1f"), ""],
            ["realised, verify priced by the cost table", _f(a["modelled_rate"], ".1f"), "1.000"],
            [f"best single width in hindsight ({a['best_width']} rows)", _f(a["best_width_rate"], ".1f"),
             _f(_inv(a["realised_over_best"]), ".3f")],
            ["per-round oracle", _f(a["oracle_rate"], ".1f"), _f(_inv(a["realised_over_oracle"]), ".3f")],
        ]
        out.append(tabulate(rates, ["", "tok/s", "over realised (priced)"], disable_numparse=True))
        out.append(f"realised / oracle = {_f(a['realised_over_oracle'], '.3f')}, realised / best width = "
                   f"{_f(a['realised_over_best'], '.3f')}, best width / oracle = {_f(a['best_over_oracle'], '.3f')}")
        loss = a["loss_ms"]
        rows = [[label, _f(loss.get(k), ".0f"), _pct(a["loss_share"].get(k))] for k, label in _CAUSES]
        rows.append(["total (time beyond the best width's rate)", _f(a["loss_total_ms"], ".0f"),
                     _pct(a["loss_total_ms"] / a["wall_ms"] if a["wall_ms"] else None)])
        out.append("\nLoss to the best single width, by cause (ms at its rate; share of the run's time)")
        out.append(tabulate(rows, ["cause", "ms", "share"], disable_numparse=True))
        host = a["host_ms"]
        rows = [[k, _f(v, ".0f"), _f(v / a["rounds"], ".3f"), _pct(v / a["wall_ms"] if a["wall_ms"] else None)]
                for k, v in host.items()]
        out.append("\nHost time (outside the verify; every arm pays it, so it is beside the loss, not in it)")
        out.append(tabulate(rows, ["part", "ms", "ms/round", "share"], disable_numparse=True))
        out.append(f"median per round outside llama_decode, rounds of up to 16 rows: {_f(a['host_median_ms'], '.3f')} ms")
        ws = sorted({int(w) for w in a["width_rates"]} | {int(w) for w in a["realised_widths"]}
                    | {int(w) for w in a["oracle_widths"]})
        rows = [[w, _f(a["width_rates"].get(str(w)), ".1f"), a["realised_widths"].get(str(w), 0),
                 a["oracle_widths"].get(str(w), 0)] for w in ws]
        out.append("\nEvery width: tok/s had every round run it, and the rounds realised and in the oracle at it")
        out.append(tabulate(rows, ["width", "tok/s fixed", "rounds realised", "rounds oracle"], disable_numparse=True))
        if a["unpriced_rounds"] or a["hindsight_mismatch"]:
            out.append(f"left out: {a['unpriced_rounds']} rounds with no measured cost; "
                       f"{a['hindsight_mismatch']} rounds accepted other than width invariance predicts (near ties)")
    return "\n".join(out) + "\n"


def step_regret_tables(accounts: list[dict]) -> str:
    """``adaspark replay --regret`` on batched steps: one step account per arm (step_regret.py)."""
    out = []
    for a in accounts:
        out.append(f"\nHindsight account of {a['arm']}'s batched steps: {a['steps']} steps, {a['rounds']} rounds, "
                   f"{a['tokens']} tokens ({a['left_out_steps']} steps left out: prompt tokens rode in them, "
                   "or a round was sampled)")
        if a["fit"] is None:
            out.append("too few steps, or rows that never varied: the step cost is not fitted")
            continue
        t0, t1, t2, t3 = a["fit"]
        out.append(f"step decode fitted as {t0:.2f} + {t1:.3f} rows + {t2:.5f} cells + {t3:.6f} rows x cells ms "
                   f"(median error {_pct(a['fit_error'])})")
        rates = [["realised (measured)", _f(a["measured_rate"], ".1f"), ""],
                 ["realised, decode priced by the fit", _f(a["modelled_rate"], ".1f"), "1.000"],
                 [f"best fixed width per request in hindsight ({a['best_width']} rows)", _f(a["best_width_rate"], ".1f"),
                  _f(_inv(a["realised_over_best"]), ".3f")],
                 ["per-step oracle", _f(a["oracle_rate"], ".1f"), _f(_inv(a["realised_over_oracle"]), ".3f")],
                 ["with the prompts' steps: measured", _f(a["with_prompts"]["measured"], ".1f"), ""],
                 ["with the prompts' steps: the others at the oracle's rate", _f(a["with_prompts"]["oracle"], ".1f"),
                  _f(a["with_prompts"]["oracle"] / a["with_prompts"]["measured"]
                     if a["with_prompts"]["oracle"] and a["with_prompts"]["measured"] else None, ".3f")]]
        out.append(tabulate(rates, ["", "tok/s", "over realised (priced)"], disable_numparse=True))
        rows = [[n, v["steps"], _f(v["realised"], ".2f"), _f(v["best_width"], ".2f"), _f(v["oracle"], ".2f")]
                for n, v in a["by_load"].items()]
        out.append("\nRows per request, by requests in the step")
        out.append(tabulate(rows, ["requests", "steps", "realised", "best fixed width", "oracle"], disable_numparse=True))
    return "\n".join(out) + "\n" if out else ""


def _inv(x):
    return None if not x else 1.0 / x

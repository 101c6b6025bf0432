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
    out.append("Acceptance prediction per request: log loss per labelled node, scored before learning (Table 2, Figure 4)")
    out.append(tabulate(rows, ["request", "rounds", "nodes", "head-based", "fitted", "change", "fitted priced", "finish"],
                        disable_numparse=True))
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
        ["rounds with n-gram candidates", ng["rounds_with_ngram"]],
        ["of those, rounds the n-gram widened the verify", _pct(ng["widened_share"])],
        ["rounds that explored an n-gram bucket", ng["explored_rounds"]],
    ], tablefmt="plain", disable_numparse=True))
    return "\n".join(out) + "\n"

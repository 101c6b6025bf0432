"""The acceptance model (paper 3.3, Eq. 6) and the head-based estimate it competes with.

Both give every candidate q = P(accepted | parent accepted). The fitted model shares one softmax
per parent over all its candidates, placed in the tree or not, plus the explicit "none" outcome
(at most one child of an accepted parent is the target's argmax):

    q_j = exp(s_j) / (1 + sum_{i in cand(parent)} exp(s_i))

    pick:    s = a0 + a1 logit h + a2 logit sigma + psi + b_req
    sibling: s = a3 + a4 log r + a5 logit h + a6 logit sigma + psi + b_req
    n-gram:  s = (a7 + d_kind) logit p_src + w_bucket + psi + b_req

psi is the context term (and, for drafter candidates, a depth term). w_bucket is the weight of
the node's bucket (kind, evidence bin, n-gram nodes above: ngram.bucket) plus, beyond the paper,
the weights of its two margins (kind and evidence; kind and nodes above), which pool what
buckets of a kind share: a bucket alone learns only from its own labels, too few to price it
well (ARCHITECTURE.md, section 5). d_kind, also beyond the paper, is the node's kind's own
deviation from the shared slope, learned with the buckets: p_src is the precision of the
request's own text, which tells how far a copy of it holds but not a chain from the memory of
other replies (used where the request's text offers no copy; on the evaluation subset its nodes
below a chain's first were accepted 0.92 of the time at p_src under 0.6 and 0.58-0.61 above it,
where the shared slope priced them 0.82-0.85). A drafter candidate the n-gram source also
proposed (agreed) adds max(0, logit p_src) and its agreed bucket's weight; one whose parent has
a different n-gram proposal (contradicted) subtracts max(0, logit p_src) and adds its
contradiction bucket's weight.

Learning: every coefficient starts from a prior derived from the features' definitions (pick
ln 2 + logit h, sibling log r, everything else 0: with the siblings' r summing to 1 this prices a
pick at exactly h) and moves by FTRL-Proximal on its deviation from the prior, gated at 3 sigma
(online.FTRL's gate: the paper's 3 sqrt(m), measured in the gradients' own scale).
The request intercept b_req adapts by AdaGrad and restarts with each request. After each round
every candidate of every accepted parent is labelled, placed or not, and, once the committed text
reaches past the verify, every candidate below a parent on the path the target's own continuation
took (hindsight labels, see ``learn``).

The head-based estimate is the drafter's own: a pick's confidence head h, a sibling's share of the
top-K softmax mass r (1 - sigma), an n-gram node's source precision p_src, all shifted by a
per-request logit offset (AdaGrad). A guard scores each round's labels under both models before
either learns from them; the fitted model prices the tree only while its decayed log loss per
labelled node is the lower.

Under a grammar (decode/grammar.py) a candidate the grammar alone allows (FORCED) is certain:
q = 1 in both estimates, and it teaches nothing. Every other candidate of a constrained round adds
its source's grammar weight (a bucket, beyond the paper): the grammar has cut what it forbids, so
what is left is likelier accepted than a free candidate with the same features, and the weight
learns by how much, shared by every constrained request (a class of its own).

The paper's exploration (a row every 16th tree round for the least-labelled n-gram bucket) is
replaced by the hindsight labels, which reach every node exploration could label, at no verify cost.

Everything reads the candidates as the round record's dicts (``Candidate.to_dict()``), so a live
run and its replay from the log run the same code on the same inputs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from adaspark_core.base.checks import VERSION_FIELD, count, fields, section
from adaspark_core.base.tree import ANCHOR, FORCED, NGRAM, P_CLIP, PICK, head_q, hindsight_path, logit
from adaspark_core.candidates.ngram import evidence_bin
from adaspark_core.learn.online import FTRL, AdaGradScalar, Decayed

FITTED, HEAD = "fitted", "head"

_S_CLIP = 30.0  # scores are clipped before exp
_LOSS_CLIP = 1e-6  # q is clipped to [1e-6, 1 - 1e-6] inside a log loss


def node_loss(q: float, y: bool) -> float:
    """Binary log loss of one labelled node."""
    q = min(max(q, _LOSS_CLIP), 1.0 - _LOSS_CLIP)
    return -math.log(q if y else 1.0 - q)


@dataclass(frozen=True)
class AcceptParams:
    """Table 14's acceptance-model constants, plus the unit of the context term."""

    coef_rate: float = 0.05  # drafter, depth and context terms: FTRL rate, stabiliser, L2
    coef_beta: float = 1.0
    coef_l2: float = 0.01
    bucket_rate: float = 0.5  # n-gram, agreed and contradiction buckets
    gate: float = 3.0  # a coefficient leaves its prior once |accumulated gradient| > 3 sqrt(m)
    n_cap: float = 400.0
    intercept_rate: float = 0.15
    intercept_band: float = 2.0
    intercept_cap: float = 16.0
    offset_rate: float = 0.15
    offset_band: float = 2.0
    guard_half_life: float = 256.0  # labelled parents
    # psi = w ln(c / unit): zero at 1,024 tokens, so the intercepts hold the level there and the
    # context term only the change per e-fold of context (an uncentred, always-positive feature
    # would share the intercepts' direction and absorb part of their shift).
    context_unit: float = 1024.0


# The prior of every drafter coefficient (paper 3.3, "Learning"); every other weight starts at 0.
# a7, the n-gram's slope on logit p_src, starts at the paper's fixed 1 but learns (beyond the
# paper): p_src is the source's precision over every position it predicted, so where the prompt
# gives little to copy the fixed slope underprices the nodes the source does offer, and the bucket
# weights, shared with requests of high p_src, cannot fix that (ARCHITECTURE.md, section 5).
PRIOR = {"a0": math.log(2.0), "a1": 1.0, "a4": 1.0, "a7": 1.0}


def features(c: dict, ctx: float, lp: float, lg=logit,
             constrained: bool = False) -> tuple[float, list[tuple[str, float]], list[tuple[str, float]]]:
    """(fixed part of the score, coefficient features, bucket features) of one candidate's s_j,
    the request intercept excluded. ``ctx`` is the context feature, ``lp`` = logit p_src, ``lg``
    the logit (a caller may pass a memoised one: a block's siblings share h and sigma). The fixed
    part carries the terms with no coefficient: the agreed / contradicted max(0, logit p_src).
    ``constrained``: the round is decoded under a grammar (its source's grammar bucket)."""
    fixed, coef, buckets = _free_features(c, ctx, lp, lg)
    if constrained:
        buckets = [*buckets, ("grammar:" + c["source"], 1.0)]
    return fixed, coef, buckets


def _free_features(c: dict, ctx: float, lp: float, lg) -> tuple[float, list[tuple[str, float]], list[tuple[str, float]]]:
    coef = [("ctx", ctx)]
    src = c["source"]
    if src == NGRAM:
        kind, ev_bin, above_bin = c["bucket"].split("/")
        coef.append(("a7", lp))
        return 0.0, coef, [("ng:" + c["bucket"], 1.0), (f"ngk:{kind}/{ev_bin}", 1.0), (f"nga:{kind}/{above_bin}", 1.0),
                           ("ngs:" + kind, lp)]
    h, share, sigma = c["h"], c["share"], c.get("sigma")
    if src == PICK:
        coef.append(("a0", 1.0))
        if h is not None:
            coef.append(("a1", lg(h)))
        if share is not None:
            coef.append(("a2", lg(share)))
    else:
        coef.append(("a3", 1.0))
        if share is not None:
            coef.append(("a4", math.log(max(share, P_CLIP))))
        if h is not None:
            coef.append(("a5", lg(h)))
        if sigma is not None:
            coef.append(("a6", lg(sigma)))
    if c["depth"] >= 2:
        coef.append((_DEPTH_KEYS[min(c["depth"], len(_DEPTH_KEYS) - 1)], 1.0))
    if c["agreed"]:
        return max(0.0, lp), coef, [(f"agree:{c['bucket']}:{src}", 1.0)]
    if c["contradicted"]:
        return -max(0.0, lp), coef, [(f"contra:{c['kind']}/{evidence_bin(c['kind'], c['evidence'])}:{src}", 1.0)]
    return 0.0, coef, []


_DEPTH_KEYS = [None, None] + [f"depth{d}" for d in range(2, 9)]  # depth 8 stands for 8 and deeper


def children_of(cands: list[dict]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for j, c in enumerate(cands):
        kids.setdefault(c["parent"], []).append(j)
    return kids


@dataclass(slots=True)
class Estimates:
    """One round's two estimates of q (the probability a candidate is accepted if its parent is)
    for every candidate, and which one the tree is built on (``priced``, the round record's name)."""

    fitted: list[float]
    head: list[float]
    priced: str  # FITTED or HEAD
    kids: dict[int, list[int]]
    ctx: float  # the round's context feature and logit p_src, for the features of labelled nodes
    lp: float
    constrained: bool = False  # the round is decoded under a grammar

    @property
    def q(self) -> list[float]:
        return self.fitted if self.priced == FITTED else self.head


@dataclass(slots=True)
class RoundScore:
    """A round's labels scored before learning: summed node losses of both models."""

    nodes: int = 0
    head_loss: float = 0.0
    fitted_loss: float = 0.0


@dataclass
class RequestFit:
    """What belongs to one request: its intercept and offset (Eq. 6's per-request terms), its last
    estimate, and its rounds waiting for the committed text to label them (hindsight labels) with
    the tokens committed since the oldest. Not stored: a request ends before a save."""

    intercept: AdaGradScalar
    offset: AdaGradScalar
    last: tuple | None = None
    pending: list = field(default_factory=list)
    committed: list = field(default_factory=list)


class AcceptanceModel:
    """Eq. 6, its learning, the head-based estimate and the guard between them.

    One request at a time, ``start_request`` begins each. Requests decoded together (a batch)
    each have a RequestFit of their own: ``start_request(id, alone=False)`` opens one beside the
    others and ``use(id)`` selects the one the next estimate and learn are for."""

    VERSION = 1  # of its section (state)

    def __init__(self, params: AcceptParams | None = None):
        self.p = p = params or AcceptParams()
        self.coef = FTRL(alpha=p.coef_rate, beta=p.coef_beta, l2=p.coef_l2, n_cap=p.n_cap, gate=p.gate, center=PRIOR)
        self.buckets = FTRL(alpha=p.bucket_rate, beta=p.coef_beta, l2=p.coef_l2, n_cap=p.n_cap, gate=p.gate)
        # Decayed summed node losses over labelled parents; y counts the labelled nodes.
        self.guard_head = Decayed(p.guard_half_life)
        self.guard_fitted = Decayed(p.guard_half_life)
        self.requests = 0
        self.fit = self._new_fit()  # the current request's
        self._fits: dict[str, RequestFit] = {}  # every open request's, by request id

    # --- per request ---

    def _new_fit(self) -> RequestFit:
        p = self.p
        return RequestFit(AdaGradScalar(p.intercept_rate, p.intercept_band, p.intercept_cap),
                          AdaGradScalar(p.offset_rate, p.offset_band))

    @property
    def intercept(self) -> AdaGradScalar:
        return self.fit.intercept

    @property
    def offset(self) -> AdaGradScalar:
        return self.fit.offset

    def start_request(self, request: str = "", alone: bool = True) -> None:
        """A request begins with its own intercept and offset; the coefficients persist. A request
        that stopped before its last round first learns what its text labelled: every open one
        when this request is decoded ``alone``, else only an earlier one of the same id."""
        if alone:
            for fit in [self.fit, *self._fits.values()]:
                self._resolve(everything=True, fit=fit)
            self._fits.clear()
        elif request in self._fits:
            self._resolve(everything=True, fit=self._fits.pop(request))
        self.fit = self._fits[request] = self._new_fit()
        self.requests += 1

    def forget_request(self, request: str) -> None:
        """``request`` ended before the round log said it began (a signal or a dropped client
        during its prompt's prefill): it is uncounted and its fit dropped, so the saved state
        is what a replay of the log gives. It learned nothing: a request learns from rounds."""
        fit = self._fits.pop(request, None)
        if fit is not None:
            if self.fit is fit:
                self.fit = self._new_fit()
            self.requests -= 1

    def use(self, request: str) -> None:
        """The next estimates and learning are for ``request`` (begun with ``start_request``)."""
        self.fit = self._fits[request]

    # --- est ---

    @property
    def fitted_wins(self) -> bool:
        """The guard: the fitted model prices while its decayed log loss per node is lower."""
        return self.guard_head.y > 0 and self.guard_fitted.x < self.guard_head.x

    def estimate(self, cands: list[dict], context: int, p_src: float, fitted_allowed: bool = True,
                 constrained: bool = False) -> Estimates:
        """Both estimates for every candidate of a round (Eq. 6 over every parent's candidates,
        placed or not, so each q is fixed before the tree is chosen), and which one prices the
        tree: the fitted model where the guard prefers it, unless not ``fitted_allowed`` (the
        ``cost`` arm: the head-based estimate always; the model still learns, so the guard's
        record is the same either way). ``constrained``: the round decodes under a grammar, whose
        FORCED candidates are certain."""
        b_req, off = self.fit.intercept.value, self.fit.offset.value
        wc, wb = self.coef.weight, self.buckets.weight
        ctx, lp = math.log(max(context, 1) / self.p.context_unit), logit(p_src)
        lg = functools.lru_cache(maxsize=None)(logit)  # one block's siblings share h and sigma
        # An n-gram node's score and head estimate depend on its bucket alone within a round, and
        # a round's deep chain shares a few buckets: each is scored once (host time per round).
        by_bucket: dict[str, float] = {}
        head_ng = head_q({"source": NGRAM}, p_src, off)
        scores, head = [], []
        for c in cands:
            if c["source"] == NGRAM:
                s = by_bucket.get(c["bucket"])
                if s is None:
                    s = by_bucket[c["bucket"]] = self._score(features(c, ctx, lp, lg, constrained), b_req, wc, wb)
                scores.append(s)
                head.append(head_ng)
            elif c["source"] == FORCED:
                scores.append(0.0)  # (not scored: q = 1 below)
                head.append(1.0)
            else:
                scores.append(self._score(features(c, ctx, lp, lg, constrained), b_req, wc, wb))
                head.append(head_q(c, p_src, off))
        kids = children_of(cands)
        fitted = [0.0] * len(cands)
        for group in kids.values():
            e = [math.exp(scores[j]) for j in group]
            denom = 1.0 + sum(e)
            for j, ej in zip(group, e):
                fitted[j] = 1.0 if cands[j]["source"] == FORCED else ej / denom
        est = Estimates(fitted, head, FITTED if fitted_allowed and self.fitted_wins else HEAD, kids, ctx, lp,
                        constrained)
        self.fit.last = (cands, est)
        return est

    @staticmethod
    def _score(feat, b_req: float, wc, wb) -> float:
        fixed, coef, buckets = feat
        s = fixed + b_req
        for k, x in coef:
            s += wc(k) * x
        for k, x in buckets:
            s += wb(k) * x
        return min(max(s, -_S_CLIP), _S_CLIP)

    # --- learning ---

    def learn(self, rec) -> RoundScore:
        """Guard, then learn from every candidate of every accepted parent; later, in hindsight,
        from the candidates below the parents the committed text reached beyond the verify.
        Returns the round's verified labels scored under both models before either learned.

        Beyond the paper, which labels only the children of verified accepted parents, a round
        waits until the tokens committed after its anchor cover its deepest candidate, or its
        request ends: under greedy decoding they are the target's own
        continuation, so they label the children of every node on the path a verify of every
        candidate would have accepted (``tree.hindsight_path``, width invariance, paper 3.5). A
        chain verified three deep then also teaches its nodes 4 to 32 deep, which a CPU verifies
        rarely: before, those buckets learned only from the wide rounds their own price allowed,
        and stayed underpriced (ARCHITECTURE.md, section 5). The paper's exploration, a row
        every 16th round for the least-labelled bucket's frontier node, existed to label nodes
        whose parents were never verified; hindsight labels every such node whose
        parent was on the true path at no verify cost, so it is gone. Delayed labels are scored
        and learned with the q of their round's start, as the verified ones are, but they leave
        the request's intercept and offset alone: they come in bursts of correlated nodes from
        one passage, long after the rounds they speak of (letting them move the intercept cost
        speed: ARCHITECTURE.md, section 5)."""
        cands = rec.candidates
        score = RoundScore()
        fit = self.fit
        if fit.pending and fit.pending[0][0].request != rec.request:
            self._resolve(everything=True)  # a request that ended without its last round
        if cands:
            if fit.last is not None and fit.last[0] is cands:
                est = fit.last[1]
            else:
                est = self.estimate(cands, rec.context, rec.p_src if rec.p_src is not None else 0.5,
                                    constrained=rec.constrained)
            fit.last = None
            row_of = {j: r for r, j in enumerate(rec.rows)}  # the anchor's row is ANCHOR -> 0
            labelled = [(parent, rec.argmax[row_of[parent]]) for parent in [ANCHOR, *rec.path]]
            self._label(cands, est, labelled, score)
            depth = max(c["depth"] for c in cands)
            if depth > len(rec.path) + 1:  # nodes below the verified labels: wait for the text
                fit.pending.append((rec, est, len(fit.committed)))
        if fit.pending:
            fit.committed += [cands[j]["token"] for j in rec.path] + [rec.bonus]
        self._resolve(everything=rec.last)
        if rec.last and self._fits.get(rec.request) is fit:
            del self._fits[rec.request]  # the request ended: nothing of it is left to learn
        return score

    def _resolve(self, everything: bool, fit: RequestFit | None = None) -> None:
        """Learn the hindsight labels of the waiting rounds whose continuation is known (all of
        them when the request ends), oldest first."""
        fit = fit or self.fit
        done = 0
        for rec, est, start in fit.pending:
            cont = fit.committed[start:]
            cands = rec.candidates
            if len(cont) < max(c["depth"] for c in cands) and not everything:
                break
            done += 1
            path = hindsight_path(cands, cont)
            # The children of path[i] are labelled by cont[i + 1]; those of the verified path
            # (and of its last node, by the bonus) already learned in learn().
            self._label(cands, est, [(path[i], cont[i + 1]) for i in range(len(rec.path), len(path))
                                  if i + 1 < len(cont)], RoundScore(), per_request=False)
        del fit.pending[:done]
        if not fit.pending:
            fit.committed = []

    def _label(self, cands: list[dict], est: Estimates, labelled: list[tuple[int, int]], score: RoundScore,
               per_request: bool = True) -> None:
        """Score (guard) and learn the children of each ``(parent, token the target chose after
        it)``: every label is scored before any of them is learned (the guard's rule), then one
        FTRL step per labelled parent, from the q of the round's start."""
        steps = []
        for parent, truth in labelled:
            group = est.kids.get(parent)
            if not group or cands[group[0]]["source"] == FORCED:  # (a forced candidate is its parent's only one)
                continue
            labels = [cands[j]["token"] == truth for j in group]
            lf = sum(node_loss(est.fitted[j], y) for j, y in zip(group, labels))
            lh = sum(node_loss(est.head[j], y) for j, y in zip(group, labels))
            self.guard_fitted.add(lf, len(group))
            self.guard_head.add(lh, len(group))
            score.nodes += len(group)
            score.fitted_loss += lf
            score.head_loss += lh
            steps.append((group, labels))
        for group, labels in steps:
            g_coef: dict[str, float] = {}
            g_bucket: dict[str, float] = {}
            g_req = g_off = 0.0
            for j, y in zip(group, labels):
                g = est.fitted[j] - y  # d(-log softmax)/ds_j
                g_req += g
                g_off += est.head[j] - y  # d(node log loss)/d(logit offset)
                _, coef, buckets = features(cands[j], est.ctx, est.lp, constrained=est.constrained)
                for k, x in coef:
                    g_coef[k] = g_coef.get(k, 0.0) + g * x
                for k, x in buckets:
                    g_bucket[k] = g_bucket.get(k, 0.0) + g * x
            self.coef.update(g_coef)
            self.buckets.update(g_bucket)
            if per_request:
                self.fit.intercept.update(g_req)
                self.fit.offset.update(g_off)

    # --- persistence (the intercept and offset are per request and not stored) ---

    def state(self) -> dict:
        return {VERSION_FIELD: self.VERSION, "coef": self.coef.state(), "buckets": self.buckets.state(),
                "guard": {"head": self.guard_head.state(), "fitted": self.guard_fitted.state()},
                "requests": self.requests}

    @classmethod
    def from_state(cls, st: dict, params: AcceptParams | None = None, path: str = "acceptance") -> "AcceptanceModel":
        """Restore a ``state()``, each part checked by its own ``load`` (checks.py)."""
        # A store written before the hindsight labels also counts exploration rows ("explore_count"): not read.
        section(st, path, cls.VERSION, ("coef", "buckets", "guard", "requests"), legacy=("explore_count",))
        m = cls(params)
        m.coef.load(st["coef"], f"{path}.coef")
        m.buckets.load(st["buckets"], f"{path}.buckets")
        guard = fields(st["guard"], f"{path}.guard", ("head", "fitted"))
        m.guard_head.load(guard["head"], f"{path}.guard.head")
        m.guard_fitted.load(guard["fitted"], f"{path}.guard.fitted")
        m.requests = count(st["requests"], f"{path}.requests")
        return m

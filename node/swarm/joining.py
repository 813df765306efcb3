"""How a node that starts behind the swarm catches up without trusting any one peer.

Claimed steps are judged against the view, parameters come from several peers, each download is checked by its
validation loss on the node's own held-out batches, the survivors are combined coordinate-wise, and a robust
step is adopted (docs/training.md, "Joining mid-run")."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import msgspec
import numpy as np

from gossip.errors import ManifestMismatch, OutOfRange, Truncated, WireError
from gossip.exchange import Delivered, PeerRejected
from gossip.mixing import coordinate_median
from gossip.pace import TransferProgress, TransferStalled
from gossip.robust import ValueBound, check_values
from node.swarm.peers import SwarmRecord
from node.swarm.prefixes import one_per_prefix
from node.swarm.spot_check import DEFAULT_SPOT, SpotRules, choose_block, compare_block, split_ranges

logger = logging.getLogger("murmur.train")

Tensors = Mapping[str, np.ndarray]


class JoinCheck(StrEnum):
    """How a joiner's download is checked (`--join-check`; docs/training.md, "Joining mid-run")."""

    AUTO = "auto"  # SPOT for a model of at least SPOT_CHECK_BYTES in fp32, else MEDIAN
    MEDIAN = "median"  # three whole copies from three donors, combined coordinate-wise
    SPOT = "spot"  # one copy, each donor's part checked against a sample of it from two other donors


SPOT_CHECK_BYTES = 256 << 20  # from ~67M parameters a copy over a home link takes minutes: one, not three


def join_check(choice: JoinCheck, numel: int) -> JoinCheck:
    """The check a joiner of a model of `numel` parameters runs for `choice`."""
    if choice is not JoinCheck.AUTO:
        return choice
    return JoinCheck.SPOT if 4 * numel >= SPOT_CHECK_BYTES else JoinCheck.MEDIAN


@dataclass(frozen=True)
class JoinRules:
    """The bounds a joiner holds the swarm's claims and downloads to."""

    check: JoinCheck = JoinCheck.MEDIAN  # AUTO is resolved by the caller (join_check)
    spot: SpotRules = DEFAULT_SPOT
    stripes: int = 4  # donors a spot-checked copy is downloaded from at once, each a range of its bytes
    sources: int = 3  # downloads combined, where the swarm has that many peers ahead
    # a claimed step more than max(step_slack, step_share x reference) above the reference is ignored
    step_slack: int = 20
    step_share: float = 0.25
    # a download is refused when its validation loss is above the node's own model's by this share ...
    worse_than_own: float = 0.02
    # ... or above the best download's by more than max(gap_share x (own - best), loss_share x best)
    gap_share: float = 0.25
    loss_share: float = 0.05
    # no node steps faster than this (a step includes a gossip round over the network): a claim of more
    # steps than the swarm's age allows is impossible
    max_steps_per_s: float = 100.0
    clock_skew_s: float = 300.0  # how far this node's clock may be behind the founder's

    def step_tolerance(self, reference: int) -> int:
        return max(self.step_slack, math.ceil(self.step_share * reference))

    def copies_moved(self, check: JoinCheck) -> float:
        """Whole copies of the model a catch-up downloads, at least: `sources` for the median; one for a spot
        check, and a block of `spot.share` of each part from two checkers (a block is one tensor at least, so
        a model of a few large tensors moves more)."""
        return float(self.sources) if check is JoinCheck.MEDIAN else 1.0 + 2 * self.spot.share

    def loss_limit(self, own: float, best: float) -> float:
        """The highest validation loss a download (or the combined model) may have."""
        return min(own * (1.0 + self.worse_than_own),
                   best + max(self.gap_share * max(0.0, own - best), self.loss_share * best))

    def combined_limit(self, own: float, best: float) -> float:
        """The highest validation loss the combination of several downloads may have: within loss_share
        of the best of them (combining is there to cancel one bad copy, not to give up what the good
        ones trained; copies that differ by as much as loss_limit allows may not average well)."""
        return min(own * (1.0 + self.worse_than_own), best * (1.0 + self.loss_share))


DEFAULT_RULES = JoinRules()
DEFAULT_BOUND = ValueBound()


class Refused(StrEnum):
    """Why a peer's claim or download was not used (JoinOutcome.refused), besides a wire error's kind."""

    STEP_OUT_OF_BOUNDS = "step_out_of_bounds"  # its claimed step is far above the swarm's, or beyond the budget
    # its record claims what no honest peer does (SPES: a capacity above the layer's expert count, expert
    # versions beyond the sync index's bound): not a download source, whatever its step
    RECORD_OUT_OF_BOUNDS = "record_out_of_bounds"
    LOSS = "loss"  # its parameters evaluate far worse than the alternatives or the node's own model
    TIMEOUT = "timeout"  # it did not answer in time, or its download outlasted its size at the goodput floor
    STALLED = "stalled"  # its download stopped moving for the stall timeout (gossip.pace)
    UNREACHABLE = "unreachable"
    REJECTED = "rejected"
    FAILED = "failed"  # an error of no declared kind: this peer's download failed, not the catch-up
    SAME_PREFIX = "same_prefix"  # another peer ahead on its network already votes and serves (node.swarm.prefixes)
    # its part of a spot-checked copy was an outlier next to two other donors' copies of a block of it
    SPOT_CHECK = "spot_check"


@dataclass(frozen=True)
class StepJudgement:
    """What the view's claimed steps say: a robust reference step and the peers worth downloading from."""

    reference: int  # the lower median of the claims of the peers ahead
    tolerance: int  # claims above reference + tolerance are ignored
    candidates: tuple[SwarmRecord, ...]  # peers ahead with believable claims, closest to the reference first
    ignored: tuple[str, ...]  # peers ahead whose claims are not believable
    # peers of the view left out before judging (judge_steps' `refused`), whatever their step, with the
    # reason: a status that names a lying record only when its peer was ahead would hide it from a
    # joiner's report whenever the liar happened to lag
    refused: Mapping[str, str] = field(default_factory=dict)

    def believable(self, step: int) -> bool:
        return step <= self.reference + self.tolerance

    def refusals(self) -> dict[str, str]:
        """Every peer ahead that is no download source, and every peer whose record was refused, and why
        (JoinOutcome.refused)."""
        return {**dict.fromkeys(self.ignored, str(Refused.STEP_OUT_OF_BOUNDS)), **self.refused}


def judge_steps(view: Sequence[SwarmRecord], me: str, step: int, margin: int, budget: int,
                plausible: int | None = None, rules: JoinRules = DEFAULT_RULES,
                refused: Mapping[str, str] | None = None) -> StepJudgement | None:
    """The peers more than `margin` steps ahead of `step`, judged by their claims; None if none is ahead.

    A claim beyond the step budget (`budget` > 0) or beyond `plausible` (the most steps the swarm can
    have made since it was founded) is impossible and ignored outright. With two or more possible
    claims ahead, the reference is their lower median, so one peer claiming a huge step cannot move
    it while another peer is ahead; claims far above it are ignored. A single peer ahead cannot be
    outvoted: its claim, within those bounds, is the reference (and its download must beat the
    node's own model, see `loss_verdicts`).

    Peers in `refused` (peer -> reason, e.g. `Refused.RECORD_OUT_OF_BOUNDS`: Algorithm.record_refusals)
    count for nothing: neither their claims nor as candidates; those in the view are kept in the
    judgement's `refused`, whatever their step.
    """
    refused = refused or {}
    everyone_ahead = [p for p in view if p.peer_id != me and p.step > step + margin]
    left_out = {p.peer_id: refused[p.peer_id] for p in view if p.peer_id != me and p.peer_id in refused}
    ahead = [p for p in everyone_ahead if p.peer_id not in refused]
    possible = [p for p in ahead if (budget <= 0 or p.step <= budget) and (plausible is None or p.step <= plausible)]
    # one vote and one download source per network, its lowest claim: one operator's identities count once
    possible, crowded = one_per_prefix(sorted(possible, key=lambda p: (p.step, p.peer_id)))
    left_out.update(dict.fromkeys((p.peer_id for p in crowded), str(Refused.SAME_PREFIX)))
    if not possible:
        return None if not everyone_ahead else StepJudgement(0, 0, (), tuple(sorted(p.peer_id for p in ahead)),
                                                             left_out)
    claims = sorted(p.step for p in possible)
    reference = claims[(len(claims) - 1) // 2]
    tolerance = rules.step_tolerance(reference)
    believable = [p for p in possible if p.step <= reference + tolerance]
    ignored = sorted({p.peer_id for p in ahead} - {p.peer_id for p in believable} - {p.peer_id for p in crowded})
    # closest to the reference first, by bands of step_slack steps (peers of one phase serve alike), and
    # within a band in an order of this joiner's own: joiners that start together spread over the donors
    # instead of all asking the same few (each donor uploads to a few at once: IncomingLimits)
    ranked = sorted(believable, key=lambda p: (abs(p.step - reference) // max(1, rules.step_slack),
                                               _donor_order(me, p.peer_id)))
    return StepJudgement(reference, tolerance, tuple(ranked), tuple(ignored), left_out)


def _donor_order(joiner: str, donor: str) -> bytes:
    """A joiner's own order of equally good donors: a hash of both ids, so it differs between joiners and
    no donor can choose to come first for all of them."""
    return hashlib.sha256(f"{joiner}\0{donor}".encode()).digest()


def swarm_left_behind(view: Sequence[SwarmRecord], me: str, step: int, margin: int, budget: int,
                      plausible: int | None = None) -> int | None:
    """The swarm's step (the lower median of the other training peers' claims) when more than half of
    them claim more than `margin` steps beyond `step`, else None: one fast peer, or one claiming a huge
    step, does not leave a node behind. Peers whose budget (`budget` > 0) is spent do not train on and
    are not counted; claims beyond the budget or beyond `plausible` are impossible and not counted either."""
    claims = sorted(p.step for p in view if p.peer_id != me and (budget <= 0 or p.step < budget)
                    and (plausible is None or p.step <= plausible))
    if 2 * sum(1 for c in claims if c > step + margin) <= len(claims):
        return None
    return claims[(len(claims) - 1) // 2]


def plausible_steps(epoch: float, now: float, rules: JoinRules = DEFAULT_RULES) -> int:
    """The most steps a swarm founded at `epoch` (its config's, signed by the founder) can have made by `now`."""
    return int(max(0.0, now - epoch + rules.clock_skew_s) * rules.max_steps_per_s) + rules.step_slack


def loss_verdicts(own_loss: float, losses: Mapping[str, float], rules: JoinRules = DEFAULT_RULES) -> dict[str, bool]:
    """Per download, whether its validation loss is acceptable next to the node's own model's and the
    other downloads' (a non-finite loss never is). A download that would be the only one kept must be
    better than the node's own model, not merely close to it: nothing else vouches for it (a copy of
    the seeded initial model served as the swarm's, say)."""
    finite = [v for v in losses.values() if math.isfinite(v)]
    if not finite:
        return dict.fromkeys(losses, False)
    limit = rules.loss_limit(own_loss, min(finite))
    verdicts = {peer: math.isfinite(v) and v <= limit for peer, v in losses.items()}
    if sum(verdicts.values()) == 1:
        verdicts = {peer: ok and losses[peer] < own_loss for peer, ok in verdicts.items()}
    return verdicts


def combine(downloads: Sequence[Tensors], into: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The coordinate-wise median of the downloads: of 3, the middle value of each coordinate (one
    hostile copy cannot move any coordinate beyond the honest two); of 2, their mean (the median of
    two values); of 1, a copy. More than 3 are not combined (the caller keeps at most `sources`).

    `into`, if given (one of the downloads, say), gets each combined tensor in place of its own as soon
    as it is made, so the combination costs one tensor beyond the downloads, not one more copy of the
    model; that download is the combination afterwards."""
    if not downloads:
        raise ValueError("nothing to combine")
    out: dict[str, np.ndarray] = {} if into is None else into
    for name in list(downloads[0]):  # names only: a list of the arrays would keep every replaced one alive
        first = downloads[0][name]
        if len(downloads) == 2:
            out[name] = ((first.astype(np.float64) + downloads[1][name]) / 2).astype(first.dtype)
        else:
            out[name] = coordinate_median([d[name].reshape(-1) for d in downloads]).reshape(first.shape)
    return out


@dataclass(frozen=True)
class Download:
    """One whole copy of the swarm's parameters: from one donor, or from several in turn when a donor broke
    off and the next one sent the tensors from where it stopped (`donors`, in that order)."""

    donors: tuple[str, ...]
    tensors: dict[str, np.ndarray]
    step: int  # the lowest its donors claimed

    @property
    def label(self) -> str:
        return "+".join(self.donors)


@dataclass
class JoinOutcome:
    """What a catch-up did: the parameters and step adopted (None: nothing adopted), and why each peer
    it considered was or was not used (reported in the node's status as `training.joined`)."""

    reference_step: int
    tensors: dict[str, np.ndarray] | None = None
    step: int = 0
    sources: tuple[str, ...] = ()
    losses: dict[str, float] = field(default_factory=dict)
    own_loss: float | None = None
    combined_loss: float | None = None
    loss: float | None = None  # the adopted parameters' validation loss, as the check measured it
    refused: dict[str, str] = field(default_factory=dict)  # peer -> Refused or a wire error's kind
    check: str = JoinCheck.MEDIAN  # how the adopted download was checked (a spot check that failed: median)
    checked: dict[str, list[str]] = field(default_factory=dict)  # spot check: donor -> the two peers it was checked against

    def vouchers(self) -> tuple[str, ...]:
        """The peers whose copies back the adopted parameters: the sources, and under a spot check the
        peers their parts were checked against (where outer state is taken from several peers: DiLoCo's
        momentum)."""
        return tuple(sorted({*self.sources, *(p for d in self.sources for p in self.checked.get(d, ()))}))

    def describe(self) -> str:
        """For the status's `started_from`: "peer A at step N" or "peers A, B, C at step N"."""
        noun = "peer" if len(self.sources) == 1 else "peers"
        return f"{noun} {', '.join(self.sources)} at step {self.step}"

    def as_dict(self) -> dict[str, object]:
        return {"reference_step": self.reference_step, "step": self.step, "sources": list(self.sources),
                "losses": dict(self.losses), "own_loss": self.own_loss, "combined_loss": self.combined_loss,
                "loss": self.loss, "refused": dict(self.refused), "check": str(self.check), "checked": dict(self.checked)}


class Fetch(Protocol):
    """A pull of a peer's current tensors, round and step (GossipPeer.fetch: its deadlines follow the
    download's progress and size, gossip.pace), its payload counted in `progress`; from the tensor at
    manifest index `start` on, and before `stop` if given. When it breaks off, `delivered` holds what
    arrived whole and the step the reply claimed."""

    def __call__(self, peer: str, progress: TransferProgress | None = None, *, start: int = 0, stop: int | None = None,
                 delivered: Delivered | None = None) -> Awaitable[tuple[dict[str, np.ndarray], int, int]]: ...


class JoinProgress(msgspec.Struct, frozen=True):
    """The downloads of a catch-up while they run (the status document's `join`, `murmur status`, the
    monitor): payload bytes received and expected over the downloads whose size is known, their
    combined rate, the time the slowest still needs at its own rate, and the peers downloaded from."""

    bytes_done: int
    bytes_total: int
    rate_bps: float
    eta_s: float | None
    donors: tuple[str, ...]

    def line(self) -> str:
        """One line for the command line: "downloading 12.3 / 400.0 MB from 2 peers, 5.1 MB/s, 76 s left"."""
        share = self.bytes_done / self.bytes_total if self.bytes_total else 0.0
        eta = f", {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        noun = f"{len(self.donors)} peers" if len(self.donors) != 1 else self.donors[0]
        return (f"downloading the swarm's parameters: {self.bytes_done / 1e6:.1f} / {self.bytes_total / 1e6:.1f} MB "
                f"({100 * share:.0f}%) from {noun}, {self.rate_bps / 1e6:.2f} MB/s{eta}")


class DownloadWatch:
    """The downloads of one catch-up as they run, one TransferProgress per peer being downloaded from."""

    def __init__(self) -> None:
        self._running: dict[str, TransferProgress] = {}

    def start(self, peer: str) -> TransferProgress:
        progress = self._running[peer] = TransferProgress(peer)
        return progress

    def end(self, peer: str) -> None:
        self._running.pop(peer, None)

    def snapshot(self) -> JoinProgress | None:
        """None while no download has read its header (its size unknown)."""
        sized = [p for p in self._running.values() if p.bytes_total]
        if not sized:
            return None
        etas = [p.eta_s for p in sized]
        return JoinProgress(bytes_done=sum(p.bytes_done for p in sized), bytes_total=sum(p.bytes_total for p in sized),
                            rate_bps=sum(p.rate_bps for p in sized),
                            eta_s=None if any(e is None for e in etas) else max(e for e in etas if e is not None),
                            donors=tuple(sorted(p.peer for p in sized)))


Evaluate = Callable[[Tensors | None], Awaitable[float]]  # validation loss of tensors (None: the node's own)


async def join_swarm(judgement: StepJudgement, fetch: Fetch, evaluate: Evaluate, own: Tensors,
                     rules: JoinRules = DEFAULT_RULES, bound: ValueBound = DEFAULT_BOUND,
                     watch: DownloadWatch | None = None) -> JoinOutcome:
    """Download up to `rules.sources` copies from believable peers, check each by its values and validation
    loss (the next candidate stands in for one that fails or is refused), and combine the survivors
    (see `combine`). The combined model is evaluated too: if it is worse than the limit (copies too
    far apart to average), the best single download is taken. The step adopted is the lower median of
    the survivors' steps. `own` is the node's current parameters (the value bound's and the loss's
    reference: the seeded initial model for a fresh node). `watch` follows the downloads as they run.

    A donor that dies or stalls mid-download leaves what it sent whole; the next candidate sends the rest
    of that copy, from the first tensor missing (`_fill`). A copy's loss is every one of its donors' in
    the outcome, and a copy refused for its loss refuses them all.

    With `rules.check` SPOT and three candidates or more, one spot-checked copy comes first
    (`_adopt_spot_checked`); the three copies only if it is not adopted."""
    watch = watch or DownloadWatch()
    outcome = JoinOutcome(judgement.reference, refused=judgement.refusals())
    waiting = list(judgement.candidates)
    if rules.check is JoinCheck.SPOT and len(waiting) >= 3:
        if await _adopt_spot_checked(waiting, judgement, fetch, evaluate, own, rules, bound, outcome, watch):
            return outcome
        waiting = [r for r in judgement.candidates if r.peer_id not in outcome.refused]  # whole copies from them
    evaluated: list[Download] = []
    kept: list[Download] = []
    losses: dict[str, float] = {}  # Download.label -> its validation loss
    while waiting and len(kept) < rules.sources:
        new = await _download(waiting, rules.sources - len(kept), judgement, fetch, own, bound, outcome, watch)
        if not new:
            break
        if outcome.own_loss is None:
            outcome.own_loss = await evaluate(None)
        for d in new:
            losses[d.label] = await evaluate(d.tensors)
            outcome.losses.update(dict.fromkeys(d.donors, losses[d.label]))
        evaluated += new
        verdicts = loss_verdicts(outcome.own_loss, {d.label: losses[d.label] for d in evaluated}, rules)
        kept = [d for d in evaluated if verdicts[d.label]]
    for d in evaluated:
        if d not in kept:
            outcome.refused.update(dict.fromkeys(d.donors, str(Refused.LOSS)))
    if not kept:
        return outcome
    assert outcome.own_loss is not None
    if len(kept) == 1:
        combined, outcome.loss = kept[0].tensors, losses[kept[0].label]
    else:
        # the combination is made in one of the downloads, not the best: that stays whole for the fallback
        best = min(kept, key=lambda d: losses[d.label])
        spent = next(d for d in kept if d is not best)
        combined = await asyncio.to_thread(combine, [d.tensors for d in kept], spent.tensors)  # is spent's now
        outcome.combined_loss = outcome.loss = await evaluate(combined)
        limit = rules.combined_limit(outcome.own_loss, min(losses[d.label] for d in kept))
        if not outcome.combined_loss <= limit:
            logger.warning("the combined download evaluates to %.4f, worse than %.4f: taking %s's alone",
                           outcome.combined_loss, limit, best.label)
            kept, combined, outcome.loss = [best], best.tensors, losses[best.label]
    steps = sorted(d.step for d in kept)
    outcome.tensors, outcome.step = combined, steps[(len(steps) - 1) // 2]
    outcome.sources = tuple(sorted(peer for d in kept for peer in d.donors))
    return outcome


async def _adopt_spot_checked(waiting: list[SwarmRecord], judgement: StepJudgement, fetch: Fetch, evaluate: Evaluate,
                              own: Tensors, rules: JoinRules, bound: ValueBound, outcome: JoinOutcome,
                              watch: DownloadWatch) -> bool:
    """`--join-check spot`: one copy, spot-checked (`_spot_checked`), adopted if its validation loss beats
    the node's own model's (a lone download's rule: nothing else vouches for all of it). False when it does
    not or the candidates ran out: the caller goes on to three copies. The copy's donors stay candidates
    for them: which of its parts let the loss down is not known, and whole copies tell."""
    outcome.check = JoinCheck.SPOT
    copy = await _spot_checked(waiting, judgement, fetch, own, rules, bound, outcome, watch)
    if copy is not None:
        outcome.own_loss = await evaluate(None)
        loss = await evaluate(copy.tensors)
        if loss_verdicts(outcome.own_loss, {copy.label: loss}, rules)[copy.label]:
            outcome.losses.update(dict.fromkeys(copy.donors, loss))
            outcome.tensors, outcome.step, outcome.sources = copy.tensors, copy.step, tuple(sorted(copy.donors))
            outcome.loss = loss
            return True
        logger.warning("the spot-checked download from %s evaluates to %.4f, not better than this node's %.4f: "
                       "downloading three copies instead", copy.label, loss, outcome.own_loss)
    else:
        logger.warning("too few donors answered to spot-check a download: downloading three copies instead")
    outcome.check = JoinCheck.MEDIAN
    return False


async def _spot_checked(waiting: list[SwarmRecord], judgement: StepJudgement, fetch: Fetch, own: Tensors,
                        rules: JoinRules, bound: ValueBound, outcome: JoinOutcome,
                        watch: DownloadWatch) -> Download | None:
    """One whole copy, its manifest split by bytes into up to `rules.stripes` ranges downloaded from as many
    donors at once (a donor that breaks off is resumed by the next candidate, from the first tensor it
    did not send). Each donor's part is checked against a block of it (node.swarm.spot_check) from two
    other candidates: a part that passes keeps the three-way median of its block; an outlier's donor is
    refused (`spot_check`) and its range downloaded again from the next candidate, and checked. None when
    the candidates run out first (donors or checkers)."""
    limits = bound.limits(own)
    names = list(own)
    nbytes = [int(t.size) * 4 for t in own.values()]  # as the fp32 answer carries them
    rng = random.SystemRandom()  # where the blocks fall: no donor can know it in advance
    checkers = [r.peer_id for r in judgement.candidates]
    pending = split_ranges(nbytes, min(rules.stripes, len(waiting)))
    passed: list[_Part] = []
    while pending:
        parts = await _striped(pending, waiting, names, judgement, fetch, limits, outcome, watch)
        if parts is None:
            return None
        pending = []
        for part in parts:
            block = choose_block(nbytes, part.start, part.stop, rules.spot.share, rng)
            against = await _check_copies(block, part.donor, checkers, 2 * len(outcome.checked), names, fetch, limits,
                                          outcome, watch, waiting)
            if against is None:
                return None
            (first, a), (second, b) = against
            mine = {name: part.tensors[name] for name in names[block[0]:block[1]]}
            verdict = await asyncio.to_thread(compare_block, mine, a, b, {n: own[n] for n in mine}, rules.spot)
            outcome.checked[part.donor] = [first, second]
            if verdict.outlier:
                outcome.refused[part.donor] = Refused.SPOT_CHECK
                logger.warning("parameter download from %s refused: tensors %d-%d are %.4g from the median of them "
                               "and %s's and %s's copies, which are %.4g from it (the median moved %.4g from ours)",
                               part.donor, block[0], block[1] - 1, verdict.distance, first, second, verdict.spread,
                               verdict.moved)
                pending.append((part.start, part.stop))
                continue
            part.tensors.update(verdict.medians)
            passed.append(part)
    passed.sort(key=lambda part: part.start)
    tensors = {name: t for part in passed for name, t in part.tensors.items()}
    return Download(tuple(dict.fromkeys(part.donor for part in passed)), tensors, min(part.step for part in passed))


async def _striped(ranges: Sequence[tuple[int, int]], waiting: list[SwarmRecord], names: Sequence[str],
                   judgement: StepJudgement, fetch: Fetch, limits: Mapping[str, float], outcome: JoinOutcome,
                   watch: DownloadWatch) -> list[_Part] | None:
    """Each of `ranges` downloaded from the next candidate of `waiting`, all at once; a donor that fails or
    breaks off is followed by the next for what it did not send, or, with no candidate left, by a donor
    that finished its own range (each part is checked on its own, so one donor may serve two). None when
    no donor is left (the donors that broke off reported with why)."""
    parts: list[_Part] = []
    spare: list[str] = []  # donors that sent their whole range
    fetching = 0  # ranges whose download runs: one may finish and free its donor
    changed = asyncio.Event()
    short = False

    async def donor() -> str | None:
        while not waiting and not spare and fetching:
            changed.clear()
            await changed.wait()
        if waiting:
            return waiting.pop(0).peer_id
        return spare.pop(0) if spare else None

    async def stripe(start: int, stop: int) -> None:
        nonlocal fetching, short
        while start < stop:
            peer = await donor()
            if peer is None:
                short = True
                return
            fetching += 1
            try:
                part = await _fetch_part(peer, start, stop, names, judgement, fetch, limits, outcome, watch)
            finally:
                fetching -= 1
                changed.set()
            if part is not None:
                parts.append(part)
                start = part.stop
                if start == stop:
                    spare.append(peer)
                    changed.set()

    async with asyncio.TaskGroup() as group:
        for start, stop in ranges:
            group.create_task(stripe(start, stop))
    if short:
        for part in parts:
            if part.broke is not None:
                outcome.refused[part.donor] = part.broke
        return None
    return parts


async def _check_copies(block: tuple[int, int], donor: str, checkers: list[str], turn: int, names: Sequence[str],
                        fetch: Fetch, limits: Mapping[str, float], outcome: JoinOutcome, watch: DownloadWatch,
                        waiting: list[SwarmRecord]) -> tuple[tuple[str, Tensors], tuple[str, Tensors]] | None:
    """Two other candidates' copies of `block`, asked in parallel, the next ones standing in for those that
    fail (unreachable, malformed, out of range: reported, and no longer donors either; one that refuses,
    busy or rate-limited, is only passed over); None when fewer than two answer. `checkers` are taken from
    `turn` on (rotated), so the checks of several parts do not all fall on the same few peers."""
    got: list[tuple[str, Tensors]] = []
    turn %= max(1, len(checkers))
    wanted = [p for p in checkers[turn:] + checkers[:turn] if p != donor and p not in outcome.refused]

    async def one(peer: str) -> None:
        try:
            try:
                tensors, _, _ = await fetch(peer, watch.start(peer), start=block[0], stop=block[1])
            finally:
                watch.end(peer)
            await asyncio.to_thread(check_values, tensors, limits)
            if list(tensors) != list(names[block[0]:block[1]]):
                raise ManifestMismatch(f"asked for tensors {block[0]}-{block[1] - 1}, got {len(tensors)} others")
        except PeerRejected as exc:  # busy uploading to others, or its rate limit: not a fault
            logger.info("spot check of %s's download: %s did not answer (%s)", donor, peer, exc)
            return
        except Exception as exc:  # any failure: this checker's, never the join's
            outcome.refused.setdefault(peer, _why(exc))
            logger.warning("spot check of %s's download against %s failed: %s: %s", donor, peer, type(exc).__name__,
                           exc)
            checkers.remove(peer)
            waiting[:] = [r for r in waiting if r.peer_id != peer]
            return
        got.append((peer, tensors))

    while len(got) < 2 and wanted:
        batch, wanted = wanted[: 2 - len(got)], wanted[2 - len(got):]
        async with asyncio.TaskGroup() as group:
            for peer in batch:
                group.create_task(one(peer))
    return (got[0], got[1]) if len(got) == 2 else None


@dataclass
class _Copy:
    """One copy being downloaded: the tensors that arrived whole so far (a prefix of the manifest), from
    whom, the steps they claimed, and why each donor that gave part of it broke off."""

    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    donors: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    breaks: dict[str, str] = field(default_factory=dict)


async def _download(waiting: list[SwarmRecord], wanted: int, judgement: StepJudgement, fetch: Fetch, own: Tensors,
                    bound: ValueBound, outcome: JoinOutcome, watch: DownloadWatch) -> list[Download]:
    """Up to `wanted` valid whole copies, downloaded in parallel, each from the first of `waiting` (taken
    off it), the next ones standing in for donors that fail; returns them by label. Each candidate serves
    one copy at most: a hostile donor's values reach one copy of the median, whatever it does."""
    limits = bound.limits(own)
    names = list(own)
    got: list[Download] = []

    async def one_copy() -> None:
        copy = _Copy()
        while waiting:
            if await _fill(copy, waiting.pop(0).peer_id, names, judgement, fetch, limits, outcome, watch):
                got.append(Download(tuple(copy.donors), copy.tensors, min(copy.steps)))
                return
        for peer, why in copy.breaks.items():  # no donor was left to finish it: what they sent is dropped
            outcome.refused[peer] = why

    async with asyncio.TaskGroup() as group:
        for _ in range(wanted):
            group.create_task(one_copy())
    return sorted(got, key=lambda d: d.label)


@dataclass(frozen=True)
class _Part:
    """Tensors [start, stop) of the manifest, as one donor sent them whole, the step it claimed, and why
    it broke off before the end of what it was asked for (None: it did not)."""

    donor: str
    start: int
    stop: int
    tensors: dict[str, np.ndarray]
    step: int
    broke: str | None = None


def _why(exc: Exception) -> str:
    """Why a peer's download or block failed, as JoinOutcome.refused reports it: the error's own kind
    where it has one, a break-off's way of ending, else `failed`."""
    if isinstance(exc, TransferStalled):
        return Refused.STALLED
    if isinstance(exc, TimeoutError):
        return Refused.TIMEOUT
    if isinstance(exc, WireError):  # truncated, out_of_range, bad_schema, ...
        return exc.kind
    if isinstance(exc, PeerRejected):
        return Refused.REJECTED
    return Refused.UNREACHABLE if isinstance(exc, ConnectionError) else Refused.FAILED


async def _fetch_part(peer: str, start: int, stop: int, names: Sequence[str], judgement: StepJudgement, fetch: Fetch,
                      limits: Mapping[str, float], outcome: JoinOutcome, watch: DownloadWatch) -> _Part | None:
    """Ask `peer` for tensors [start, stop); what it sent whole, or None (the reason in `outcome.refused`).
    What a donor that broke off (died, stalled, cut, timed out) sent whole is kept, if its values and step
    pass; a donor that refused, sent something malformed or out of range, or claims an unbelievable step
    adds nothing."""
    delivered = Delivered()
    broke: str | None = None
    step: int | None
    try:
        try:
            tensors, _, step = await fetch(peer, watch.start(peer), start=start, stop=stop, delivered=delivered)
        finally:
            watch.end(peer)
    except (TimeoutError, ConnectionError, Truncated) as exc:
        tensors, step = delivered.tensors, delivered.step
        broke = _why(exc)
        logger.warning("parameter download from %s broke off after %d of tensors %d-%d: %s", peer,
                       len(delivered.tensors), start, stop - 1, exc or type(exc).__name__)
    except (WireError, PeerRejected) as exc:
        outcome.refused[peer] = _why(exc)
        logger.warning("parameter download from %s failed: %s", peer, exc)
        return None
    except Exception as exc:  # the backstop: one peer's failure never ends the catch-up
        outcome.refused[peer] = _why(exc)
        logger.warning("parameter download from %s failed: %s: %s", peer, type(exc).__name__, exc)
        return None
    # what was asked for, in order, as far as it arrived (a peer of an older murmur answers from the first)
    wanted = list(itertools.takewhile(lambda name: name in tensors, names[start:stop]))
    tensors = {name: tensors[name] for name in wanted}
    try:
        await asyncio.to_thread(check_values, tensors, limits)
    except OutOfRange as exc:
        outcome.refused[peer] = exc.kind
        logger.warning("parameter download from %s refused: %s", peer, exc)
        return None
    if step is not None and not judgement.believable(step):
        outcome.refused[peer] = Refused.STEP_OUT_OF_BOUNDS
        logger.warning("parameter download from %s refused: it claims step %d, the swarm's is about %d",
                       peer, step, judgement.reference)
        return None
    if not tensors or step is None:
        outcome.refused[peer] = broke or Refused.FAILED
        return None
    return _Part(peer, start, start + len(tensors), tensors, step, broke if start + len(tensors) < stop else None)


async def _fill(copy: _Copy, peer: str, names: Sequence[str], judgement: StepJudgement, fetch: Fetch,
                limits: Mapping[str, float], outcome: JoinOutcome, watch: DownloadWatch) -> bool:
    """Ask `peer` for the tensors `copy` lacks (`_fetch_part`); whether the copy is whole now."""
    start = len(copy.tensors)
    part = await _fetch_part(peer, start, len(names), names, judgement, fetch, limits, outcome, watch)
    if part is None:
        return False
    if start:
        logger.info("resumed a download at tensor %d of %d from %s, after %s broke off", start, len(names), peer,
                    ", ".join(copy.donors))
    copy.tensors.update(part.tensors)
    copy.donors.append(peer)
    copy.steps.append(part.step)
    if part.broke is not None:
        copy.breaks[peer] = part.broke
    return len(copy.tensors) == len(names)

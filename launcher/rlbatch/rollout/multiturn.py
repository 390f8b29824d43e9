"""Multi-turn continuous batching on the built-in engine's per-slot decoder (token level).

The decoding loop knows token ids and "this row waits"; everything about environments (their
calls, rendering observations, the episode limits they decide) is the turn driver's
(rlbatch.env.driver.TurnDriver, passed in, never imported here):

- up to ``num_slots`` rows decode at once, each in its own KV-cache slot;
- a row whose assistant turn ends with EOS is handed to the driver (``submit``) and leaves the
  decode batch; the other rows decode one more token meanwhile, then the driver's answers are
  collected (``collect``: observation ids, or None when the episode is over);
- a row that goes on re-enters its slot with its EOS and observation tokens: a prefill of those
  new tokens on top of the row's cache (nothing before them is recomputed);
- a row that ends frees its slot for the next waiting prompt.

Limits: ``params.max_new_tokens`` per assistant turn and ``max_response[row]`` tokens per
trajectory (everything after the prompt: env.max_total_tokens - prompt length); a turn cut by
either, or an observation that leaves no room for another assistant token, ends the episode as
truncated. The driver
decides max_turns and cuts observations to env.max_observation_tokens. A row re-enters at the
decode step after the one in which its turn ended, so which rows share a step never depends on
how long an environment took: same seed, same samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional, Protocol

import torch

from rlbatch.grpo.types import Prompt, Sample
from rlbatch.rollout.sampling import SamplingParams, sample_tokens


class TurnDriver(Protocol):
    """What the decoding loop needs from the multi-turn driver (rlbatch.env.driver)."""

    def submit(self, row: int, turn_ids: list[int]) -> None:
        """Row ``row`` ended an assistant turn (its tokens, EOS included): step its episode."""
        ...

    def collect(self) -> dict[int, Optional[list[int]]]:
        """Every row submitted since the last call -> the observation ids to append, or None
        when its episode is over (waits for the calls)."""
        ...

    def end(self, row: int, reason: str, turn_ids: list[int]) -> None:
        """The loop ended row ``row``'s episode for ``reason`` (max_new_tokens,
        max_total_tokens): in the middle of an assistant turn (its tokens so far), or ([])
        before appending the observation it was given."""
        ...


@dataclass
class Trajectory:
    """One row's response: every token after the prompt with its mask and logprob."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    truncated: bool = False
    turn_start: int = 0
    """Index in ids where the current assistant turn starts."""
    servers: list[Optional[str]] = field(default_factory=list)
    """The rollout server of each decoded turn (rollout.backend=vllm_server; None elsewhere)."""
    routing: Any = None
    """MoE, recorded by the decoder: ``[prompt + len(ids), num_moe_layers, k]`` the experts
    each token of the episode was routed to as it was fed (rlbatch.engine.routing)."""

    def add_sampled(self, token: int, logp: float) -> None:
        self.ids.append(token)
        self.mask.append(1)
        self.logps.append(logp)

    def add_observation(self, ids: Sequence[int]) -> None:
        self.ids += list(ids)
        self.mask += [0] * len(ids)
        self.logps += [0.0] * len(ids)
        self.turn_start = len(self.ids)


@dataclass
class SlotStats:
    """Decode-step occupancy (rlbatch-bench rollout --env): slot-steps decoded while at least
    one row waited on its environment, out of the slots that existed then."""

    steps: int = 0
    waiting_steps: int = 0
    busy_slot_steps_while_waiting: int = 0
    slot_steps_while_waiting: int = 0
    tokens: int = 0

    @property
    def busy_fraction_while_waiting(self) -> float:
        return self.busy_slot_steps_while_waiting / max(self.slot_steps_while_waiting, 1)


# ------------------------------------------------------------------------------ episode rules
# What ends a turn and an episode, for both turn loops (this module's on the built-in engine's
# per-slot decoder, rlbatch.rollout.turns' on a TokenBackend): written once, so an episode ends
# for the same reason whichever engine decodes it.


def turn_end(traj: Trajectory, eos: bool, max_new_tokens: int, max_response: int) -> str:
    """Why the current assistant turn of ``traj`` ends after its last sampled token: ''
    (it goes on), 'turn' (EOS: the environment's turn), or the limit that ends the episode
    (``max_total_tokens``: the trajectory's budget; ``max_new_tokens``: the turn's)."""
    if eos:
        return "turn"
    if len(traj.ids) >= max_response:
        return "max_total_tokens"
    if len(traj.ids) - traj.turn_start >= max_new_tokens:
        return "max_new_tokens"
    return ""


def close_turn(driver: TurnDriver, row: int, traj: Trajectory, why: str) -> bool:
    """Hand an ended turn to the driver: True when the row waits for its observation ('turn'),
    False when a limit ended the episode (truncated)."""
    if why == "turn":
        driver.submit(row, traj.ids[traj.turn_start :])
        return True
    traj.truncated = True
    driver.end(row, why, traj.ids[traj.turn_start :])
    return False


def take_observation(
    driver: TurnDriver,
    row: int,
    traj: Trajectory,
    observation: Optional[list[int]],
    max_response: int,
) -> bool:
    """Append the driver's answer to a waiting row: True when its episode goes on. None ends
    it; an observation that leaves no room for another assistant token ends it as truncated
    (the driver is told, with no turn tokens)."""
    if observation is not None and len(traj.ids) + len(observation) >= max_response:
        traj.truncated = True
        driver.end(row, "max_total_tokens", [])
        return False
    if observation is None:
        return False
    traj.add_observation(observation)
    return True


class _Batch:
    """Which row each slot holds and the rows decoding now (with their next-token logits)."""

    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.row_of: list[int] = [-1] * num_slots
        self.active: list[int] = []  # slots decoding, ascending
        self.logits: Optional[torch.Tensor] = None  # [len(active), V]
        self.device = device
        self.freed: list[tuple[int, int]] = []  # (slot, row) whose episode ended this step

    def free(self) -> list[int]:
        return [s for s, r in enumerate(self.row_of) if r < 0]

    def free_slot(self, slot: int) -> None:
        """The row in ``slot`` ended its episode: the slot takes the next prompt."""
        self.freed.append((slot, self.row_of[slot]))
        self.row_of[slot] = -1

    def set_active(self, parts: dict[int, torch.Tensor]) -> None:
        """parts: slot -> logits [V]; the active set becomes these slots."""
        self.active = sorted(parts)
        self.logits = torch.stack([parts[s] for s in self.active]) if parts else None


def decode_turns(
    decoder: Any,
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    keys: torch.Tensor,
    num_slots: int,
    driver: TurnDriver,
    max_response: Sequence[int],
    stats: Optional[SlotStats] = None,
) -> list[Trajectory]:
    """Multi-turn rollouts of every row on a per-slot decoder (see the module docstring).

    Each step runs up to three forwards, in this order: decode (the rows that go on), extend
    (the rows whose observation came back), prefill (new prompts in freed slots). An MoE
    decoder at expert parallelism > 1 (``decoder.expert_parallel``) exchanges tokens with its
    expert group in every forward, so the group's ranks agree before each phase whether any of
    them runs it (one all-reduce for decode and one for extend + prefill); a rank with nothing
    for a phase some peer runs, or with no rows left while a peer has some, runs the decoder's
    idle forward (each MoE layer on one zero token) in its place. Samples do not change."""
    stats = stats if stats is not None else SlotStats()
    trajs = [Trajectory() for _ in prompt_ids]
    queue = deque(sorted(range(len(prompt_ids)), key=lambda r: -len(prompt_ids[r])))
    batch = _Batch(num_slots, decoder.device)
    keys = keys.to(decoder.device)
    step = _InStep(decoder)
    refill = _plan_refill(batch, queue)
    (anyone,) = step.agree([bool(refill)])
    batch.set_active(step.run(bool(refill), anyone, partial(_prefill, decoder, refill, prompt_ids)))
    while True:
        going: dict[int, int] = {}  # slot -> token to feed
        waiting: dict[int, int] = {}  # slot -> its last token (EOS), fed on re-entry
        if batch.active:
            _sample_turns(batch, trajs, params, keys, driver, max_response, going, waiting)
            _count(stats, len(batch.active), len(going), bool(waiting), num_slots)
        alive, decoding = step.agree([bool(batch.active), bool(going)])
        if not alive:
            break
        parts = step.run(bool(going), decoding, partial(_decode, decoder, going, num_slots))
        back = _answers(batch, waiting, driver, trajs, max_response) if waiting else {}
        _keep_routing(decoder, batch, trajs, prompt_ids)
        refill = _plan_refill(batch, queue)
        extending, filling = step.agree([bool(back), bool(refill)])
        parts.update(step.run(bool(back), extending, partial(_extend, decoder, back)))
        parts.update(
            step.run(bool(refill), filling, partial(_prefill, decoder, refill, prompt_ids))
        )
        batch.set_active(parts)
    return trajs


class _InStep:
    """Phases of a decoding step agreed over the expert-parallel group (an MoE decoder at
    parallel.ep > 1); without it every call is local and free."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.on = bool(getattr(decoder, "expert_parallel", False))

    def agree(self, flags: list[bool]) -> list[bool]:
        """Per flag: whether it holds on some rank of the group."""
        if not self.on:
            return flags
        from rlbatch import distributed

        return distributed.any_in_expert_group_each(flags)

    def run(self, mine: bool, anyone: bool, forward: Any) -> dict[int, torch.Tensor]:
        """This rank's forward of the phase, or the idle forward when only peers run it."""
        if mine:
            parts: dict[int, torch.Tensor] = forward()
            return parts
        if anyone and self.on:
            self.decoder.idle()
        return {}


def _sample_turns(
    batch: _Batch,
    trajs: list[Trajectory],
    params: SamplingParams,
    keys: torch.Tensor,
    driver: TurnDriver,
    max_response: Sequence[int],
    going: dict[int, int],
    waiting: dict[int, int],
) -> None:
    """Sample the next token of every active row; fill ``going`` (it decodes on) and
    ``waiting`` (its turn ended: handed to the driver); a row whose episode ended frees its
    slot."""
    rows = [batch.row_of[s] for s in batch.active]
    assert batch.logits is not None
    steps = torch.tensor([len(trajs[r].ids) for r in rows], device=batch.device)
    tok, lp = sample_tokens(batch.logits, params, keys[rows], steps)
    for slot, row, t, logp in zip(batch.active, rows, tok.tolist(), lp.tolist(), strict=True):
        traj = trajs[row]
        traj.add_sampled(t, logp)
        why = turn_end(traj, params.ends(t), params.max_new_tokens, max_response[row])
        if why == "":
            going[slot] = t
        elif close_turn(driver, row, traj, why):
            waiting[slot] = t
        else:
            batch.free_slot(slot)


def _keep_routing(
    decoder: Any, batch: _Batch, trajs: list[Trajectory], prompt_ids: Sequence[Sequence[int]]
) -> None:
    """The routing the decoder recorded (MoE) of the episodes that ended this step, taken
    before their slots take new prompts."""
    if getattr(decoder, "routing", None) is not None:
        for slot, row in batch.freed:
            length = len(prompt_ids[row]) + len(trajs[row].ids)
            trajs[row].routing = decoder.routing_of(slot, length)
    batch.freed.clear()


def _decode(decoder: Any, going: dict[int, int], num_slots: int) -> dict[int, torch.Tensor]:
    slots = sorted(going)
    every = len(slots) == num_slots  # every slot decodes: no gather of the caches
    index = None if every else torch.tensor(slots, device=decoder.device)
    feed = torch.tensor([going[s] for s in slots], device=decoder.device)
    return dict(zip(slots, decoder.decode(feed, index), strict=True))


def _count(stats: SlotStats, active: int, decoded: int, any_waiting: bool, slots: int) -> None:
    stats.steps += 1
    stats.tokens += active
    if any_waiting:
        stats.waiting_steps += 1
        stats.busy_slot_steps_while_waiting += decoded
        stats.slot_steps_while_waiting += slots


def _answers(
    batch: _Batch,
    waiting: dict[int, int],
    driver: TurnDriver,
    trajs: list[Trajectory],
    max_response: Sequence[int],
) -> dict[int, list[int]]:
    """The driver's answers for the rows that waited: finished rows free their slot; the others
    re-enter with [their EOS] + observation: ``{slot: tokens to feed}``."""
    answers = driver.collect()
    feeds: dict[int, list[int]] = {}
    for slot, last in sorted(waiting.items()):
        row = batch.row_of[slot]
        observation = answers[row]
        if not take_observation(driver, row, trajs[row], observation, max_response[row]):
            batch.free_slot(slot)
            continue
        assert observation is not None
        feeds[slot] = [last, *observation]
    return feeds


def _extend(decoder: Any, feeds: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Prefill of the re-entering rows' new tokens on top of their caches."""
    slots = sorted(feeds)
    return dict(zip(slots, decoder.extend(slots, [feeds[s] for s in slots]), strict=True))


def _plan_refill(batch: _Batch, queue: deque[int]) -> dict[int, int]:
    """Free slots take the next prompts: ``{slot: row}``, the slots marked taken."""
    slots = batch.free()[: len(queue)]
    plan = {slot: queue.popleft() for slot in slots}
    for slot, row in plan.items():
        batch.row_of[slot] = row
    return plan


def _prefill(
    decoder: Any, plan: dict[int, int], prompt_ids: Sequence[Sequence[int]]
) -> dict[int, torch.Tensor]:
    """Prefill of the planned slots' prompts; their logits by slot."""
    slots = list(plan)
    logits = decoder.prefill(slots, [prompt_ids[plan[s]] for s in slots])
    return dict(zip(slots, logits, strict=True))


def episode_samples(
    rows: Sequence[tuple[int, Prompt]],
    trajs: Sequence[Trajectory],
    episodes: Sequence[dict[str, Any]],
    version: int,
) -> list[Sample]:
    """The ``Sample`` of each row's episode (either engine's turn loop): its model and observation
    tokens with their loss mask, behaviour logprobs of the model tokens, and the episode record;
    truncated when the model's last turn or the episode was cut."""
    return [
        Sample(
            prompt=p,
            group_id=g,
            response_ids=t.ids,
            behaviour_logps=t.logps,
            truncated=t.truncated or ep["truncated"],
            policy_version=version,
            loss_mask=t.mask,
            episode=ep,
            routing=t.routing,
        )
        for (g, p), t, ep in zip(rows, trajs, episodes, strict=True)
    ]

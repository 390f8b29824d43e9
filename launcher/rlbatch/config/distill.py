"""The on-policy distillation keys (``grpo.distill``): a teacher scores every token the student
sampled and its per-token log-prob minus the behaviour log-prob becomes a dense advantage, alone
or beside the group reward advantage (docs/grpo_loss.md, "On-policy distillation")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rlbatch.config.enums import DistillEstimator, FilterGroups, PolicyLoss, RolloutBackend
from rlbatch.config.errors import ConfigError


@dataclass
class DistillConfig:
    teacher: Optional[str] = None
    """A local Hugging Face directory (a run's <run_dir>/hf included) whose model scores the
    student's sampled tokens; null = no distillation. Built frozen on the run's tp / pp layout;
    its tokenizer must be the student's; not model.hf_path itself. On resume it may move when
    its *.safetensors are the same (the checkpoint's digest)."""
    teacher_url: Optional[str] = None
    """A served teacher instead (exclusive with teacher): http://HOST:PORT of a vLLM server of
    the teacher (rlbatch-serve model.hf_path=TEACHER, or vLLM's own server with
    --enable-scale-out) whose prompt log-probs score the sampled tokens; needs
    rollout.temperature=1. Its model directory must be readable here (tokenizer check) and
    hold weights (not rlbatch-serve's dummy ones); never a rollout server (same host and port
    as one of rollout.servers.urls, or weights a sync labelled). On resume it may change when it
    serves the same teacher (the checkpoint's probe log-probs)."""
    teacher_tokenizer: Optional[str] = None
    """For a teacher_url served from another machine: a local directory with the teacher's
    config.json and tokenizer files (or a Hub id in the local Hugging Face cache), read only
    for the checks before launch (tokenizer, context) when the server's model directory cannot
    be read here; null = the served directory itself, or its Hub id in the local cache."""
    teacher_timeout_s: float = 300.0
    """Longest one scoring request to grpo.distill.teacher_url may take before the run stops
    naming the server."""
    teacher_max_concurrency: int = 32
    """Scoring requests in flight to grpo.distill.teacher_url at once, per model replica (the
    server batches them)."""
    coef: float = 1.0
    """Weight of the per-token teacher advantage (teacher log-prob minus behaviour log-prob)."""
    reward_coef: float = 1.0
    """Weight of the group reward advantage; 0 = pure distillation: no reward is computed and no
    reward function is called."""
    kl_estimator: DistillEstimator = DistillEstimator.reverse_kl
    """The per-token teacher advantage: reverse_kl = log pi_teacher - log pi_behaviour of the
    sampled token (the one estimator on sampled tokens; docs/grpo_loss.md says why not top-k)."""
    clip: Optional[float] = None
    """Clamp each per-token log-prob difference to [-clip, clip] before coef (extreme tokens the
    teacher finds near impossible); null = no clamp. distill/clip_frac counts the clamped tokens."""


def distill_on(cfg: Any) -> bool:
    """A teacher scores the rollouts (grpo.distill.teacher or grpo.distill.teacher_url set)."""
    return bool(cfg.grpo.distill.teacher or cfg.grpo.distill.teacher_url)


def served_teacher(cfg: Any) -> bool:
    """The teacher is a vLLM server (grpo.distill.teacher_url), not a model built in-process."""
    return bool(cfg.grpo.distill.teacher_url)


def pure_distillation(cfg: Any) -> bool:
    """A teacher and grpo.distill.reward_coef=0: no reward is computed, so the data needs no
    reference answers and no reward function is loaded or checked."""
    return distill_on(cfg) and cfg.grpo.distill.reward_coef == 0


def reward_weight(cfg: Any) -> float:
    """The weight of the group reward advantage in the combined one: grpo.distill.reward_coef
    with a teacher, 1 without (plain GRPO)."""
    return float(cfg.grpo.distill.reward_coef) if distill_on(cfg) else 1.0


def distill_errors(cfg: Any) -> list[ConfigError]:
    """Every problem of the grpo.distill keys (pure: config.json is read, no model built)."""
    d, errors = cfg.grpo.distill, []
    if d.clip is not None and d.clip <= 0:
        errors.append(ConfigError("grpo.distill.clip", d.clip, "must be > 0 or null (no clamp)"))
    if d.coef < 0:
        errors.append(ConfigError("grpo.distill.coef", d.coef, "must be >= 0"))
    if d.reward_coef < 0:
        errors.append(ConfigError("grpo.distill.reward_coef", d.reward_coef, "must be >= 0"))
    errors += _served_errors(cfg)
    if not distill_on(cfg):
        if d.reward_coef == 0:
            errors.append(
                ConfigError(
                    "grpo.distill.teacher",
                    None,
                    "grpo.distill.reward_coef=0 (pure distillation) needs a teacher: set it to "
                    "the teacher's Hugging Face directory (e.g. a finished run's <run_dir>/hf), "
                    "set grpo.distill.teacher_url to a served teacher, or raise "
                    "grpo.distill.reward_coef",
                )
            )
        return errors
    if d.coef == 0 and d.reward_coef == 0:
        errors.append(
            ConfigError(
                "grpo.distill.coef",
                d.coef,
                "with grpo.distill.reward_coef=0 nothing would be learnt: set coef > 0",
            )
        )
    errors += _teacher_dir_errors(cfg)
    errors += _objective_errors(cfg)
    if d.reward_coef == 0:
        errors += _pure_distillation_errors(cfg)
    return errors


def _teacher_dir_errors(cfg: Any) -> list[ConfigError]:
    """An in-process teacher's directory: it exists and is not the student's own checkpoint."""
    d, errors = cfg.grpo.distill, []
    if d.teacher and not Path(d.teacher).is_dir():
        errors.append(
            ConfigError(
                "grpo.distill.teacher",
                d.teacher,
                "no such directory: a local Hugging Face model directory (config.json and "
                "*.safetensors), e.g. a finished run's <run_dir>/hf",
            )
        )
    student = cfg.model.hf_path
    if d.teacher and student and Path(d.teacher).is_dir() and Path(student).is_dir():
        if Path(d.teacher).resolve() == Path(student).resolve():
            errors.append(
                ConfigError(
                    "grpo.distill.teacher",
                    d.teacher,
                    f"is the student's own checkpoint (model.hf_path={student}): the teacher "
                    "would score every sampled token at the behaviour policy's own log-prob and "
                    "nothing would be learnt; set it to the stronger model's directory",
                )
            )
    return errors


def _objective_errors(cfg: Any) -> list[ConfigError]:
    """Objectives that cannot take a per-token teacher advantage."""
    errors = []
    if PolicyLoss(cfg.grpo.policy_loss) == PolicyLoss.gspo:
        errors.append(
            ConfigError(
                "grpo.policy_loss",
                "gspo",
                "GSPO clips one sequence ratio against one advantage per sample; the teacher's "
                "advantage differs per token: use grpo.policy_loss=gspo_token (GSPO's per-token "
                "form, arXiv 2507.18071 eq. 13), clip, cispo or sapo",
            )
        )
    return errors


def _pure_distillation_errors(cfg: Any) -> list[ConfigError]:
    """Keys that read a reward, which pure distillation (reward_coef=0) never computes."""
    errors = []
    if FilterGroups(cfg.grpo.filter_groups) != FilterGroups.none:
        errors.append(
            ConfigError(
                "grpo.filter_groups",
                cfg.grpo.filter_groups.value,
                "pure distillation (grpo.distill.reward_coef=0) computes no reward to filter "
                "groups on: set grpo.filter_groups=none",
            )
        )
    if cfg.grpo.overlong_buffer_len > 0:
        errors.append(
            ConfigError(
                "grpo.overlong_buffer_len",
                cfg.grpo.overlong_buffer_len,
                "the overlong penalty is a part of the reward, and pure distillation "
                "(grpo.distill.reward_coef=0) computes no reward: set grpo.overlong_buffer_len=0,"
                " or grpo.distill.reward_coef > 0 to train on the reward (and its penalty) too",
            )
        )
    return errors


def _served_errors(cfg: Any) -> list[ConfigError]:
    """The served teacher's own keys (what its server serves is checked before launch by
    rlbatch.grpo.served_teacher)."""
    d, errors = cfg.grpo.distill, []
    if d.teacher_timeout_s <= 0:
        errors.append(
            ConfigError("grpo.distill.teacher_timeout_s", d.teacher_timeout_s, "must be > 0")
        )
    if d.teacher_max_concurrency < 1:
        errors.append(
            ConfigError(
                "grpo.distill.teacher_max_concurrency", d.teacher_max_concurrency, "must be >= 1"
            )
        )
    if d.teacher_tokenizer and not d.teacher_url:
        errors.append(
            ConfigError(
                "grpo.distill.teacher_tokenizer",
                d.teacher_tokenizer,
                "is only read for a served teacher (grpo.distill.teacher_url), which is not set:"
                " set it to null, or set grpo.distill.teacher_url",
            )
        )
    if not d.teacher_url:
        return errors
    if d.teacher:
        errors.append(
            ConfigError(
                "grpo.distill.teacher_url",
                d.teacher_url,
                f"is exclusive with grpo.distill.teacher={d.teacher}: a teacher is either built "
                "in-process from a directory or served; set one of them to null",
            )
        )
    if not str(d.teacher_url).startswith(("http://", "https://")):
        errors.append(
            ConfigError(
                "grpo.distill.teacher_url",
                d.teacher_url,
                "is not an http:// or https:// URL: write it as http://HOST:PORT",
            )
        )
    on_servers = RolloutBackend(cfg.rollout.backend) == RolloutBackend.vllm_server
    same = [u for u in cfg.rollout.servers.urls or [] if same_server(str(d.teacher_url), str(u))]
    if on_servers and same:
        errors.append(
            ConfigError(
                "grpo.distill.teacher_url",
                d.teacher_url,
                f"is the server {same[0]} of rollout.servers.urls (same host and port): every "
                "weight sync of the student would replace the teacher's weights on it; serve "
                "the teacher on a server of its own",
            )
        )
    if cfg.rollout.temperature != 1.0:
        errors.append(
            ConfigError(
                "rollout.temperature",
                cfg.rollout.temperature,
                "a served teacher (grpo.distill.teacher_url) scores tokens with vLLM's prompt "
                "log-probs, which come from the raw logits (temperature 1), while the teacher "
                "must score at the behaviour policy's temperature: set rollout.temperature=1, "
                "or build the teacher in-process with grpo.distill.teacher=DIR (any temperature)",
            )
        )
    return errors


def server_address(url: str) -> tuple[frozenset[str], int]:
    """Where ``url`` points: its host's addresses (every name of this machine, localhost,
    127.0.0.0/8, ::1 and 0.0.0.0 alike, as "local") and its port."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = -1
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, port)}
    except (OSError, UnicodeError):
        found = {host}  # a name that does not resolve here: compared as written
    try:
        own = {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}
    except (OSError, UnicodeError):
        own = set()
    out = set()
    for a in found:
        try:
            ip = ipaddress.ip_address(a.split("%")[0])
        except ValueError:
            out.add(a)
            continue
        local = ip.is_loopback or ip.is_unspecified or a in own
        out.add("local" if local else str(ip))
    return frozenset(out), port


def same_server(a: str, b: str) -> bool:
    """Two URLs reach the same server: same port and a host address in common (after resolving
    names: http://localhost:8000 and http://127.0.0.1:8000/ are one server)."""
    (hosts_a, port_a), (hosts_b, port_b) = server_address(a), server_address(b)
    return port_a == port_b and bool(hosts_a & hosts_b)


def distill_warnings(cfg: Any) -> list[str]:
    """A warning for each distill key set away from its default without a teacher; under pure
    distillation, one for each reward setting that then goes unused."""
    d, default = cfg.grpo.distill, DistillConfig()
    if pure_distillation(cfg):
        return _unused_rewards(cfg)
    if distill_on(cfg):
        return []
    return [
        f"grpo.distill.{key}={getattr(d, key)} is ignored: grpo.distill.teacher is null"
        for key in ("coef", "reward_coef", "clip", "kl_estimator")
        if getattr(d, key) != getattr(default, key)
        and not (key == "reward_coef" and d.reward_coef == 0)
    ]


def _unused_rewards(cfg: Any) -> list[str]:
    """What pure distillation leaves unused: an environment's step rewards, and data.reward_fn
    when evaluation does not score with it either."""
    out = []
    why = "pure distillation (grpo.distill.reward_coef=0) computes and trains on no reward"
    if cfg.env.path:
        out.append(
            f"env.path={cfg.env.path}: the environment's step rewards are not trained on or "
            f"logged: {why} (its observations still shape the episodes)"
        )
    # evaluation (eval.every_steps > 0) scores with data.reward_fn unless eval has its own
    scored = cfg.eval.every_steps > 0 and not cfg.eval.reward_fn and cfg.eval.reward is None
    if cfg.data.reward_fn and not scored:
        out.append(f"data.reward_fn={list(cfg.data.reward_fn)} is ignored: {why}")
    return out

"""Config group ``env``: multi-turn environments and tool calls (docs/environments.md).

With ``env.path`` null (the default) rollouts are single-turn: one prompt, one completion,
exactly as without this group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rlbatch.config.enums import EnvOnError, OnDivergence, ToolParser


@dataclass
class AgentConfig:
    """The OpenAI-compatible endpoint an ``env.harness`` calls (docs/agents.md)."""

    host: str = "127.0.0.1"
    """Address the endpoint binds to (0.0.0.0: harnesses in other containers or hosts; set
    env.agent.auth_token then, and env.agent.advertise_host)."""
    advertise_host: Optional[str] = None
    """The host the harness's ``base_url`` names: the address a harness in another container or
    on another host reaches this machine by. null = env.agent.host, or 127.0.0.1 when that
    binds every interface (0.0.0.0, ::)."""
    port: int = 0
    """Port of data-parallel rank 0's endpoint (rank r binds port + r); 0 = any free port."""
    auth_token: Optional[str] = None
    """Bearer token every call must carry (the harness's client is given it); null = none."""
    tool_parser: ToolParser = ToolParser.hermes
    """How tool calls are read from a completion's text: hermes (``<tool_call>{json}</tool_call>``,
    Qwen2.5 / Qwen3 / Hermes), none (the text is the content)."""
    on_divergence: OnDivergence = OnDivergence.split
    """A call whose messages are not the episode's earlier turns (the harness rewrote or cut its
    history): split (a new segment starts there, trained as one more sample with the episode's
    reward and advantage; counted in ``episode_splits``), error (stop the run naming the
    episode and the call)."""
    episode_timeout_s: float = 300.0
    """Longest one episode (the harness's run call) may take; beyond it the episode is an
    error (env.on_error decides what that does). The hang detector waits on a round of
    episodes for its waves of env.max_concurrency times this + 5 s, plus trainer.timeout_s, on
    every data-parallel rank."""
    block_timeout_s: float = 10.0
    """Longest a harness may hold the rank's event loop without awaiting (synchronous code:
    ``time.sleep``, a blocking tool); beyond it that episode is an error naming it and the line
    it blocks at (raise_error stops the run; zero_reward scores it 0 and restarts the others
    on a fresh loop)."""
    openenv_url: Optional[str] = None
    """An OpenEnv environment served over HTTP (``http://host:port``): episodes run through the
    built-in OpenEnv harness instead of env.harness: one server session per episode, reset with
    the row's seed, each assistant reply turned into an action and stepped, each observation the
    next user message; the reward is the environment's rewards summed (docs/agents.md). The
    server must take env.max_concurrency sessions per data-parallel rank at once."""
    openenv_action: Optional[str] = None
    """How the policy's reply becomes the OpenEnv environment's action: ``PATH.py:fn`` or
    ``module:fn``, ``fn(text, observation) -> dict`` (or the environment's Action model); null =
    the action's only required text field set to the reply (environments whose action is one
    string; any other action needs a function)."""
    verifiers: Optional[str] = None
    """A verifiers environment (the verifiers package, 0.4): its taskset's id (an installed
    module, as verifiers loads it) or a local ``.py`` file or package directory. Its taskset's
    tasks are the dataset (instead of data.source / data.path), each episode is its own rollout
    (verifiers' Env, harness and interception) with every model call through the run's endpoint,
    and the reward is its rewards' weighted sum (each logged). Exclusive with env.harness,
    env.path and env.agent.openenv_url (docs/agents.md)."""
    verifiers_on_host: bool = False
    """Run on this machine what a verifiers environment keeps in a sandbox: a seat that declares
    a container or remote runtime runs in the subprocess runtime here, and a ``bash`` harness's
    tools and a colocated toolset's (one placed in the agent's runtime) run the policy's calls
    here, as the trainer's user. The policy can then read and
    change every file that user can (the environment's source with its answers, hidden tests
    and reward code, the run directory, the installed packages) and reach the network. false:
    such an environment is refused before launch (docs/agents.md)."""
    verifiers_port_timeout_s: float = 90.0
    """How long a verifiers tool server (a ``python -m`` process of the taskset's module) has to
    report its port once started: every start, before launch, a rank's shared servers and a
    task's own ones per episode. Past it, an error with the server's log saying what its module
    must do (serve from its ``__main__`` block; load slow things in the toolset's setup); verifiers
    itself would wait 180 s and name no fix."""
    verifiers_check_timeout_s: float = 120.0
    """How long the pre-launch check (rlbatch-train, rlbatch-eval) waits for the verifiers
    taskset's shared tool servers to start, all of them together; past it, the environment's key
    is a configuration error. It prints a line every 10 s from the 5th second on while it
    waits."""


@dataclass
class EnvConfig:
    path: Optional[str] = None
    """Environment class by import path: ``PATH.py:Class`` or ``module.path:Class`` (built-ins:
    ``rlbatch.env.calculator:Calculator``, ``rlbatch.env.guess_number:GuessNumber``); null =
    single-turn rollouts."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments the environment class is constructed with."""
    harness: Optional[str] = None
    """An agent harness by import path (``PATH.py:function`` or ``module:function``): ``async
    def run(client, model, row)`` calling the run's OpenAI-compatible endpoint through an
    ``openai.AsyncOpenAI`` client, returning the episode's reward (docs/agents.md). Exclusive
    with env.path."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """The endpoint env.harness calls."""
    max_turns: int = 4
    """Assistant turns per episode; an episode still going after this many is truncated
    (env.harness: a call past it is answered with no tokens and finish_reason=length)."""
    max_observation_tokens: int = 64
    """Tokens of one rendered observation, its chat wrapper included; a longer one has its
    content cut (the wrapper kept) to this many (``observations_cut`` metric). Must exceed the
    wrapper of data.chat_template (qwen with the byte tokenizer: 84)."""
    max_total_tokens: int = 256
    """Tokens of a whole trajectory (prompt, every assistant turn and observation); reaching it
    ends the episode as truncated. Also the longest sequence the token budgets must hold."""
    timeout_s: float = 30.0
    """Longest one reset / step call may take; beyond it the call counts as an error.
    env.harness: how long the other episodes' calls wait for an episode working on its own
    between two calls before they decode without it (docs/agents.md)."""
    max_concurrency: int = 16
    """Threads that run synchronous reset / step calls at once (async ones share one loop)."""
    on_error: EnvOnError = EnvOnError.raise_error
    """What an exception, timeout or wrong return type of env.path or env.harness does.
    raise_error: stops the run naming the environment (or harness), the sample and the turn;
    zero_reward: that episode ends with reward 0 (every reward part 0) and is trained, so a
    crash is paid 0, above any wrong answer scored below 0 (the policy learns to crash: use it
    only with rewards >= 0); skip: that episode ends and is left out of training: none of its
    tokens carries loss or counts in a divisor, and its group's baseline and scale are computed
    over the other episodes (a group left with fewer than 2 trains none:
    ``env_error_groups_untrained``). Counted in ``env_errors`` either way."""
    max_error_fraction: float = 0.5
    """zero_reward or skip: a step where more than this fraction of the episodes that reached
    the environment failed is a warning; a step where all of them failed stops the run."""


def multi_turn(env: EnvConfig) -> bool:
    """Rollouts are episodes (an environment's turns or a harness's calls), each sample bounded
    by env.max_total_tokens rather than one prompt and one completion."""
    return bool(env.path or harness_spec(env))


OPENENV_HARNESS = "rlbatch.rollout.agent.openenv:OpenEnvHarness"
"""What runs an episode when env.agent.openenv_url is set (its error messages name it)."""
VERIFIERS_HARNESS = "rlbatch.rollout.agent.verifiers_env:VerifiersHarness"
"""What runs an episode when env.agent.verifiers is set."""


def harness_spec(env: EnvConfig) -> Optional[str]:
    """The harness episodes run through: env.harness, or the built-in OpenEnv harness when
    env.agent.openenv_url is set, or the built-in verifiers harness when env.agent.verifiers is
    (exclusive: config rules refuse two of them); None = no harness."""
    if env.harness:
        return env.harness
    if env.agent.openenv_url:
        return OPENENV_HARNESS
    return VERIFIERS_HARNESS if env.agent.verifiers else None


def harness_key(env: EnvConfig) -> str:
    """The key that turned harness episodes on (for error messages and their fixes)."""
    if env.harness:
        return "env.harness"
    if env.agent.openenv_url:
        return "env.agent.openenv_url"
    return "env.agent.verifiers" if env.agent.verifiers else "env.harness"

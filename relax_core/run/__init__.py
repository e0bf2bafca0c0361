"""``relax run``: the inference side of RL steps closed into a loop with a trainer.

- :mod:`~relax_core.run.config`: the job file's ``[run]`` table (:class:`RunConfig`);
- :mod:`~relax_core.run.data`: the prompt sources (generated arithmetic, JSONL files);
- :mod:`~relax_core.run.generate`: the producer (groups of samples through the rollout route);
- :mod:`~relax_core.run.job`: what a run brings up on Ray (managers in actors, the trainer,
  the coordinator, the batch sink) and takes down;
- :mod:`~relax_core.run.loop`: the step loop;
- :mod:`~relax_core.run.trainer`: the trainer interface and the built-in trainer (its model in
  :mod:`~relax_core.run.policy`, its loss in :mod:`~relax_core.run.loss`; both need torch);
- :mod:`~relax_core.run.measure`: ``--measure``, phase switches against a copy of their bytes;
- :mod:`~relax_core.run.progress`: what is printed.

See ``docs/run.md``.
"""

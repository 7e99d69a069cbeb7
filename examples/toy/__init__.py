"""The main job's parts (``examples/ppo_toy.py`` runs them; ``examples/vlm_toy.py`` shares them).

- :mod:`toy.cli`, :mod:`toy.checks`: the command line and its validation (pure Python, before torch is imported),
  and the command that continues a run (printed after Ctrl-C)
- :mod:`toy.losses`: the ``--policy-loss`` table
- :mod:`toy.settings`: run-defining settings and the values derived from the arguments
- :mod:`toy.rundir`: the run directory, the metrics file, the newest checkpoint
- :mod:`toy.launch`: ``main``: validate, set up the layout, run, one line and exit 2 for a refusal
- :mod:`toy.task`: the "count on" task and its rewards
- :mod:`toy.model`: train states, step configs, the KL controller
- :mod:`toy.sampling`, :mod:`toy.collectives`: the sampler through Megatron's forward-only schedule
- :mod:`toy.rollout`: prompts -> responses -> rewards -> advantages -> old/reference log-probs
- :mod:`toy.distill`: ``--distill-from``: the teacher run, its model in the step, the distillation term
- :mod:`toy.loop`: the training loop, checkpoints, resume, the final report
- :mod:`toy.plot`, :mod:`toy.progress`, :mod:`toy.profiling`: the plot, sinks and progress, ``--profile-step``
"""

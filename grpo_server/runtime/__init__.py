"""The experiments: one owner each (`experiment.Experiment`), created and found by the orchestrator, with
what they are made of: prompts, groups, advantages, the journal, training, version checks, metrics logs."""

"""One experiment's owner (owner.py's `Experiment`), its verbs a module each: see owner.py."""

from grpo_server.runtime.experiment.owner import MAX_ERRORS_SHOWN, RECENT_GROUPS, Experiment
from grpo_server.runtime.experiment.sampling import sample_and_score

__all__ = ["Experiment", "MAX_ERRORS_SHOWN", "RECENT_GROUPS", "sample_and_score"]

"""The native API (`routes.py`): experiments, completions, feedback, adapters."""

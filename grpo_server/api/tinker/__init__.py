"""The Tinker API (`routes.py`): the `tinker` SDK's training and sampling calls on this server's experiments."""

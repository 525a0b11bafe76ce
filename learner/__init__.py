"""The learner: one base model, one LoRA adapter + DeepSpeed engine per experiment, on 1 or N ranks.

Map: __main__ (entry point, config) -> job (rank 0 serves, the other ranks follow) with ranks (starting
and watching the ranks, the process group) and lockstep (rank 0 drives the state-changing verbs on every
rank) -> app (the verbs on grpo_server/protocol/dispatch.py, msgpack) -> trainer (MultiAdapterTrainer) -> resume
(an added experiment's newest version and checkpoint, restored), sharding (each rank's share of a batch),
batching (micro-batches), policy_loss (GRPO family), engine (DeepSpeed, exact gradient accumulation), metrics,
checkpoint (durable state, one optimizer shard per rank), adapter_io (versions on disk, peft/vLLM format).
Errors are grpo_server/protocol/errors.py's ApiError kinds.
"""

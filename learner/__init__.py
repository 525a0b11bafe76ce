"""The learner: one base model, one LoRA adapter + DeepSpeed engine per experiment, on 1 or N ranks.

Map: __main__ (entry point, config) -> job (rank 0 serves, the other ranks follow) with ranks (starting
and watching the ranks, the process group) and lockstep (rank 0 drives the state-changing verbs on every
rank) -> app (HTTP verbs, msgpack) -> trainer (MultiAdapterTrainer) -> sharding (each rank's share of a
batch), batching (micro-batches), loss (GRPO family), engine (DeepSpeed, exact gradient accumulation),
metrics, checkpoint (durable state, one optimizer shard per rank), adapter_io (versions on disk, peft/vLLM
format), errors.
"""

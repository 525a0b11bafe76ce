"""The learner process: one base model, one LoRA adapter + DeepSpeed engine per experiment.

Map: __main__ (entry point, config, distributed env) -> app (HTTP verbs, msgpack) -> trainer
(MultiAdapterTrainer) -> batching (micro-batches), loss (GRPO family), engine (DeepSpeed, exact
gradient accumulation), metrics, adapter_io (versions on disk, peft/vLLM format), errors.
"""

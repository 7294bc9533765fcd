"""Where users train: one module per training stack (FSDP1, DeepSpeed ZeRO, Megatron's
``main_grad``, per-rank experts, the DDP comm hook), so a new stack is one new file."""

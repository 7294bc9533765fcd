"""``gradwatch doctor``'s checks (CPU and CUDA) and options, and the instruments behind the cost
claims (timing harness, op and host-read counters)."""

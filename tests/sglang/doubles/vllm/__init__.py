"""TEST DOUBLE, not vLLM: only `vllm._custom_ops.rotary_embedding`, in pure torch (see _custom_ops)."""

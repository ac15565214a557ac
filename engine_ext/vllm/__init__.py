"""The vLLM plugin: carries engine_ext's telemetry into real vLLM deployments (docs/vllm-plugin.md)."""

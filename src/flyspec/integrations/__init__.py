"""Other inference engines running flyspec's verification rules (the vLLM plugin)."""

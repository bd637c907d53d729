"""Stand-ins for vLLM where the real engine cannot show what a test needs."""

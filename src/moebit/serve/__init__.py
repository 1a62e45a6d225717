"""moebit serve: an OpenAI-compatible server with continuous batching (see docs/serving.md)."""

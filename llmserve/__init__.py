"""llmserve: continuous-batching LLM serving over gRPC."""

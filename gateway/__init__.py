"""Gateway: the public gRPC API; validation, tokenization and streaming text back."""

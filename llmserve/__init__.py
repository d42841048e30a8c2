"""llmserve: continuous-batching LLM serving over gRPC."""

__all__ = ["AsyncClient", "Client", "Completion"]


def __getattr__(name: str):
    """`from llmserve import Client` without importing grpc for the rest of the package."""
    if name in __all__:
        from llmserve import client

        return getattr(client, name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")

"""llmcommon: the library the three services and the application share, apart from both:
serving (server, health, flags), internal and client
authentication, the wire protocol's metadata, the model-file lookup, the request checks that the
gateway and the scheduler both apply, and the metrics endpoint.

The layers, as `make lint` checks them (import-linter, pyproject.toml; docs/architecture.md):

    llmserve.cli                                    the command line
    llmserve.demo | llmserve.bench                  the demo; benchmarks (the `bench` extra)
    llmserve.prometheus                             a Prometheus server for a stack
    llmserve.stack | llmserve.client | ...          a stack of processes; the Python client
    gateway | scheduler_svc | worker_svc            the services (independent of each other)
    llmcommon                                       this package
    llmcommon.v1                                    the generated gRPC stubs

A layer imports only the layers below it: no service and nothing here imports `llmserve`,
the application package."""
